"""`accel launch`: the user's own script on N processes, under accel's rank supervisor."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from accel.cli.app import fail
from accel.cli.options import MasterAddr, MasterPort, NodeRank, Nodes, Opt, Oversubscribe
from accel.errors import UserError


def launch(
    ctx: typer.Context,
    script: Annotated[
        Path, typer.Argument(help="Your Python script (e.g. one that calls accel.apply); its own arguments follow it.")
    ],
    gpus: Annotated[int, Opt("--gpus", help="Processes (GPUs; gloo ranks on a CPU-only machine).")] = 2,
    nnodes: Nodes = 1,
    node_rank: NodeRank = 0,
    master_addr: MasterAddr = None,
    master_port: MasterPort = None,
    oversubscribe: Oversubscribe = False,
    timeout: Annotated[
        float,
        Opt(
            "--timeout",
            help="Seconds a rank may keep the others waiting in a collective before the job ends, naming it.",
        ),
    ] = 600.0,
) -> None:
    """Run your own script on N processes (torchrun's environment); a failing or stuck rank is named, ending the job."""
    from accel import preflight
    from accel.launch.environment import LaunchSpec
    from accel.launch.supervisor import launch as launch_job

    try:
        if gpus < 1:
            raise UserError(f"--gpus must be >= 1, got {gpus}")
        if not script.is_file():
            raise UserError(f"{script}: no such script")
        if timeout <= 0:
            raise UserError(f"--timeout must be > 0 seconds, got {timeout:g}")
        spec = LaunchSpec.for_world(gpus, nnodes, node_rank, master_addr, master_port, timeout)
        preflight.check_process_count(spec.nproc, "auto", oversubscribe, spec.nnodes)  # the script picks its device
        preflight.check_master_port(master_addr, master_port, node_rank)
    except UserError as error:
        fail(str(error))
        return
    raise typer.Exit(launch_job(spec, "accel.launch", [str(script), *ctx.args]))
