"""`accel inspect`'s human output: the JSON of accel/models/inspect_json.py as a panel and tables, so the
two outputs never say different things."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def inspect_view(found: dict[str, Any]) -> RenderableType:
    """A panel of what accel found, then the block lists, then the accelerators."""
    family, parallel, accel = found["family"], found["parallel"], found["accelerators"]
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold", no_wrap=True)
    summary.add_column()
    summary.add_row("pipeline", found["pipeline"])
    if family["tested"]:
        summary.add_row("family", f"{family['title']} ({family['name']}), tested family")
    else:
        summary.add_row("family", "none: not a tested family")
        summary.add_row("refused" if found["refused"] else "generic path", found["refused"] or found["generic"])
    for transformer in found["transformers"]:
        heads = f", {transformer['heads']} heads" if transformer["heads"] is not None else ""
        summary.add_row("transformer", f"{transformer['attr']}: {transformer['class']}{heads}")
    summary.add_row("streams", ", ".join(found["streams"]) or "none declared")
    plan = parallel["plan"] or "none (one process)"
    if parallel["plan"] == "automatic":
        plan += ": learned from the model and verified on simulated ranks at first use"
    elif parallel["plan"] == "diffusers _cp_plan" and not found["family"]["tested"]:
        plan += (
            ": its streams learned from the model, verified on simulated ranks at first use (else the automatic plan)"
        )
    summary.add_row("CP plan", plan)
    for verdict in parallel.get("verdicts", []):
        layout = f"ulysses {verdict['ulysses']} × ring {verdict['ring']}"
        summary.add_row(
            f"  {layout}",
            ("verified exact" + (f" ({verdict['source']})" if verdict.get("source") else ""))
            if verdict["exact"]
            else f"refused: {verdict['reason']}",
        )
    modes = [f"{mode} {'yes' if on else 'no'}" for mode, on in parallel["modes"].items()]
    summary.add_row(
        "parallel",
        " · ".join(modes) + (f" (heads {parallel['heads']} bound ulysses and tp)" if parallel["heads"] else ""),
    )
    for mode, why in parallel["refused"].items():
        summary.add_row(f"  no {mode}", why)

    blocks = Table(title="block lists", header_style="bold")
    for column in ("transformer", "attribute", "count", "block class", "returns", "found by"):
        blocks.add_column(column, no_wrap=column != "returns")
    for transformer in found["transformers"]:
        for block in transformer["blocks"]:
            count = "?" if block["count"] is None else str(block["count"])
            returns = ", ".join(block["returns"]) if block["returns"] is not None else f"unknown: {block['unknown']}"
            blocks.add_row(transformer["attr"], block["attr"], count, block["class"] or "?", returns, block["found_by"])

    vae = accel["vae"]
    tools = Table(title="accelerators", header_style="bold")
    tools.add_column("accelerator", no_wrap=True)
    tools.add_column("applies")
    tools.add_row("cache", ", ".join(accel["cache"]) or "no")
    tools.add_row("quantization", ", ".join(accel["quant"]) or "no")
    tools.add_row("compile", accel["compile"] or "no")
    tools.add_row("VAE tiling", _yes(accel["vae_tiling"]))
    split = f"yes ({vae['method']})" if vae["parallel"] else "no: accel does not split this VAE class"
    tools.add_row("parallel VAE", f"{split}; {vae['class'] or 'no VAE'}")
    placement = accel["placement"]
    encoders = ", ".join(accel["text_encoders"]) or "none"
    tools.add_row("text encoders", f"{encoders}: {' / '.join(placement['text_encoder'])}")
    tools.add_row("VAE placement", " / ".join(placement["vae"]))
    return Group(Panel(summary, title=f"accel inspect {found['model']}", expand=False), blocks, tools)
