"""Multi-process start-up: run a command on N local ranks, and bring the failing rank's message home.

`supervisor.launch(spec, module, args)` starts `python -m module args` once per local rank with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, …; `environment`), so
`init_process_group()` and `accel.apply` work unchanged, and then supervises them (`supervisor.Supervisor`):

- the first rank to fail is named with its own cause (its one-line report, its exit code or the
  signal that killed it) and the others are stopped at once; their follow-on "connection reset"
  errors are not shown as the cause (`diagnosis`);
- a rank the others wait for in a collective for longer than `timeout_s` is named from the ranks'
  heartbeats (`accel.watchdog`);
- Ctrl-C / SIGTERM stop every rank (each runs in its own process group, so its helpers go too),
  print `interrupted`, exit 130 / 143 and leave no job folder and no half-written output;
- if the launcher itself is killed, each rank's watchdog sees its parent gone and exits;
- a rank that reported success (`reports.report_finished`, from `accel.rank_exit`) but still runs
  `finish_grace_s` later is stopped and named with where it was: the job ends with its real outcome.

We do not run torchrun's elastic agent in-process any more: it could not order failures, hid exit
codes of ranks that left no report, and answered Ctrl-C with its own traceback.

`python -m accel.launch SCRIPT ARGS` (`__main__`) is the rank side of `accel launch`: it runs a user's script.

This package imports nothing itself: library code reading its rank (`environment`) does not load the supervisor.
"""
