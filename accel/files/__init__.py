"""Output files appear whole or not at all, and never under a name another run is writing.

Every file accel writes (images, videos, JSON, bench reports and figures) is written to a hidden
temporary name in the same folder and renamed into place only when complete, so a kill mid-write
leaves no 0-byte PNG or truncated MP4 at the final name (`publish`). Publishing without replacing uses
`os.link`, which fails when the name exists: of two runs aiming at one path, one is refused rather
than both "succeeding" and one result silently lost. `claims.claim` refuses the second of two runs at
start-up, before it spends minutes generating; `publish.write_fresh` and `folders.fresh_folder` pick
default names without the check-then-create race.

No name accel creates is followed where it is a symbolic link: the lock is opened with O_NOFOLLOW
and a temporary is created with O_EXCL (`exclusive_create`), so a link planted by anyone who can write
the folder is refused in one line, and its target left untouched. Writers that take a file object write
through the descriptor that created the temporary (`exclusive_create.open_created`), so a link swapped in
after the creation is not written through either. A write that fails (ENOSPC, EIO, a read-only
mount) after the long work is not lost silently: the result is written to the system's temporary
folder instead and the one-line error says where.

Temporary names are remembered (`in_flight`), so whatever stops a job can remove them (`cleanup`):
`discard_temps` in this process (the rank watchdog, when the launcher has died), and `remove_listed_temps`
in the launcher after it killed the ranks (each rank lists its temporaries in the job's folder, `ACCEL_JOB_DIR`).

Stdlib only: the rank watchdog imports it before torch. This package imports nothing itself.
"""
