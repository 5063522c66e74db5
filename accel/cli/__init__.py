"""The `accel` command: parses flags into a Recipe and hands it to the runner. Nothing else.

app.py holds the Typer app and `main`; options.py the options built from the recipe's keys; one
module a command (plan, models, inspect and env share info.py). They are registered here, in the
order `accel --help` lists them."""

from accel.cli import batch, bench, info, launch, run, serve, tune
from accel.cli.app import Command, app, main

for command in (run.run, bench.bench, tune.tune, serve.serve, batch.batch):
    app.command(cls=Command)(command)
# Everything after SCRIPT is the script's, -h and --help included (torchrun's convention).
app.command(
    cls=Command,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
)(launch.launch)
for command in (info.plan, info.models, info.inspect, info.env):
    app.command(cls=Command)(command)

__all__ = ["app", "main"]
