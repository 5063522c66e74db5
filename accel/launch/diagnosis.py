"""What went wrong in a job, in the lines the launcher prints: the rank that failed first and why,
the rank the others wait for, the rank that finished but never exited. Pure functions of what the
ranks left in the job folder (`accel.launch.reports`) and their exit codes.
"""

from __future__ import annotations

import re
import signal

STALE_BEAT_S = 3.0  # a rank whose heartbeat is this old no longer runs Python (stopped, frozen)


def lingering(rank: int, beat: dict | None, grace_s: float, now: float) -> str:
    """The line for a rank that finished its work but did not exit: where its heartbeat last saw it."""
    if beat is None:
        where = "no heartbeat"
    elif now - beat["time"] < STALE_BEAT_S:
        where = f"waiting at {beat['where']}"
    else:
        where = f"last seen at {beat['where']} {now - beat['time']:.0f} s ago"
    return f"rank {rank} finished its work but had not exited {grace_s:.0f} s later ({where})"


def stall(beats: dict[int, dict], running: set[int], timeout_s: float, now: float) -> str | None:
    """The one line naming who the others wait for, once a rank has waited in a collective for
    `timeout_s`; None while nobody has waited that long."""
    waited = {
        r: now - b["since"]
        for r, b in beats.items()
        if r in running and b["waiting"] and now - b["time"] < STALE_BEAT_S
    }
    if not waited or max(waited.values()) < timeout_s:
        return None
    return _culprits(beats, running, now, waited)


def _culprits(beats: dict[int, dict], running: set[int], now: float, waited: dict[int, float]) -> str:
    waiters = sorted(waited)
    how_long = f"{max(waited.values()):.0f} s"
    silent = sorted(r for r in running if r not in beats or now - beats[r]["time"] >= STALE_BEAT_S)
    elsewhere = sorted(r for r in running if r not in waited and r not in silent)
    waiting_ranks = f"rank{'s' if len(waiters) > 1 else ''} {_list(waiters)}"
    if elsewhere:
        where = "; ".join(f"rank {r} was at {beats[r]['where']}" for r in elsewhere)
        return (
            f"rank{'s' if len(elsewhere) > 1 else ''} {_list(elsewhere)} stopped making progress: {waiting_ranks} "
            f"waited {how_long} for it in a collective ({where})"
        )
    if silent:
        return (
            f"rank{'s' if len(silent) > 1 else ''} {_list(silent)} stopped responding (no heartbeat); "
            f"{waiting_ranks} waited {how_long} for it in a collective"
        )
    where = "; ".join(f"rank {r} at {beats[r]['where']}" for r in waiters)
    return f"every rank waited {how_long} in a collective the others never joined ({where})"


def _list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def failure_report(
    reports: list[dict], exits: dict[int, int], beats: dict[int, dict], stalled: str | None
) -> tuple[list[str], int]:
    """The lines naming what went wrong first, and the job's exit code (2 if it was a user error).

    A rank's own report (a user error, its exception) or a rank that died without one is the cause;
    a rank that only lost its peers (a collective failing because another rank died or hung) is a
    consequence and is summarised in one line."""
    own = [r for r in reports if not r.get("lost")]
    lost = [r for r in reports if r.get("lost")]
    reported = {r["rank"] for r in reports}
    lines: list[str] = []
    if stalled is not None:
        lines.append(stalled)
    messages: dict[str, list[int]] = {}
    for report in own:
        messages.setdefault(report["message"], []).append(report["rank"])
    user_errors = {r["message"] for r in own if r.get("exit_code") == 2}
    for message, ranks in messages.items():
        # One message from every rank, or a user error (every rank would hit it; the job stops at the first)
        shared = len(messages) == 1 and (len(ranks) > 1 or message in user_errors)
        lines.append(f"{'' if shared else f'rank {_list(ranks)}: '}{message}")
    if stalled is None and not own:
        for failed_rank, code in sorted(exits.items()):
            if failed_rank not in reported:
                lines.append(f"rank {failed_rank} {_exit_cause(code)}")
    if not lines and lost:  # every report is a follow-on: the heartbeats tell whom they waited for
        gave_up = sorted(r["rank"] for r in lost)
        elsewhere = sorted(r for r, beat in beats.items() if not beat["waiting"] and r not in gave_up)
        if elsewhere:
            where = "; ".join(f"rank {r} was at {beats[r]['where']}" for r in elsewhere)
            lines.append(
                f"rank{'s' if len(elsewhere) > 1 else ''} {_list(elsewhere)} stopped making progress: "
                f"rank{'s' if len(gave_up) > 1 else ''} {_list(gave_up)} gave up waiting for it in a collective "
                f"({where})"
            )
    if lost:
        ranks = sorted(r["rank"] for r in lost)
        if lines:
            lines.append(
                f"rank{'s' if len(ranks) > 1 else ''} {_list(ranks)} stopped with it ({_short(lost[0]['message'])})"
            )
        else:
            lines.extend(f"rank {r['rank']}: {r['message']}" for r in lost)
    if not lines:
        lines.append("the job failed without a report from any rank")
    return lines, 2 if user_errors else 1


def _exit_cause(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code} without a message"


def _short(message: str, limit: int = 100) -> str:
    """A follow-on error in brief: its first sentence, without the backend's source locations."""
    line = re.sub(r"\[[^\]]*\](?::\d+)?:?\s*", "", message.splitlines()[0] if message else "")
    line = line.split(". ", 1)[0].strip().rstrip(".")
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0] + " …"
