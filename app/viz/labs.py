"""What a browser reads about its run in a lab's line: a snapshot (plain data: ``app.labs.queue``'s) in, plain data
with one sentence in the page's language out (``text``), for the streamed lines and the status answers. The line
itself is not read here: ``app/labs/lines.py`` hands in the message of a stopped run."""

from __future__ import annotations

from collections.abc import Callable

from app.errors import UserError
from app.i18n import translate

# A snapshot's ``event``: the states of ``app.labs.queue`` (a test holds the two lists equal).
QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"


def nth(n: int, lang: str) -> str:
    """1st, 2nd, 3rd, 4th … 11th, 12th, 13th … 21st (English); the bare number where a language needs no suffix."""
    if n % 100 in (11, 12, 13) or n % 10 not in (1, 2, 3):
        return translate("line.nth.n", lang, n=n)
    return translate(f"line.nth.{n % 10}", lang, n=n)


def duration(seconds: float, lang: str) -> str:
    """About how long: whole seconds up to a minute and a half, then minutes."""
    if seconds < 90:
        return translate("line.seconds", lang, s=max(1, round(seconds)))
    return translate("line.minutes", lang, m=round(seconds / 60))


def event_view(snap: dict, lang: str, progress_text: Callable[[dict, str], str], stopped: UserError | None = None
               ) -> dict:
    """``snap`` as JSON-ready data plus ``text``: the place in line, the progress, or how it ended (``stopped``:
    the message of a run that was stopped or replaced)."""
    out = {k: v for k, v in snap.items() if k != "error"}
    event = snap["event"]
    eta = snap.get("eta_s")
    if event == QUEUED:
        place = nth(snap["place"], lang)
        text = (translate("line.place_eta", lang, nth=place, eta=duration(eta, lang)) if eta is not None
                else translate("line.place", lang, nth=place))
    elif event == RUNNING:
        text = progress_text(snap["progress"], lang) if snap["progress"] else translate("line.starting", lang)
        if eta is not None:
            text = translate("line.left", lang, text=text, eta=duration(eta, lang))
    elif event == DONE and snap.get("partial"):  # stopped at the time limit, with what it had finished
        part = snap["partial"]
        text = translate("line.done_partial", lang, seconds=f"{part['seconds']:g}", done=part["done"], of=part["of"])
    elif event == DONE:
        text = (translate("line.done_cached", lang) if snap["cached"]
                else translate("line.done", lang, seconds=f"{snap['seconds']:.1f}"))
    elif event == FAILED:
        error = snap.get("error")
        text = error.text(lang) if isinstance(error, UserError) else translate("err.server", lang)
    else:  # stopped (by its browser, its client going, a limit), or replaced by a newer run of this browser
        text = stopped.text(lang) if stopped is not None else translate("line.stopped", lang)
    out["text"] = text
    return out


def arena_progress(progress: dict, lang: str) -> str:
    """Where an arena run is: full attention's reference pass, then policy i of n, teacher-forced then free."""
    if progress.get("phase") == "reference":
        key = "arena.progress.reference_free" if progress.get("free") else "arena.progress.reference"
        return translate(key, lang, step=progress["step"], steps=progress["steps"])
    name = translate(f"arena.policy.{progress['name']}", lang)
    key = "arena.progress.free" if progress.get("free") else "arena.progress.forced"
    return translate(key, lang, i=progress["policy"], n=progress["policies"], name=name, step=progress["step"],
                     steps=progress["steps"])


def train_progress(progress: dict, lang: str) -> str:
    loss = progress.get("loss")
    return translate("train.status.line", lang, step=progress["step"], steps=progress["steps"],
                     loss="–" if loss is None else f"{loss:.4f}")
