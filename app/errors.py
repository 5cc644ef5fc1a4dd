"""Errors a user can cause. Each carries a message meant for a person and an HTTP status.

A message is a catalog key plus parameters (``BadInput("err.layer_range", layer=7, last=5)``), so the
error handler can say it in the language of the request that caused it. ``message`` is the English text
(logs, tests). A string that is not a catalog key is shown as it is: new code should always use keys
(``tests/test_i18n.py`` checks that every key raised in ``app/`` has an English and a Chinese entry).
"""

from __future__ import annotations


class UserError(Exception):
    status = 400

    def __init__(self, key: str, /, **params: object) -> None:
        self.key = key
        self.params = params
        super().__init__(self.text("en"))

    def text(self, lang: str = "en") -> str:
        from app.i18n import translate

        try:
            return translate(self.key, lang, **self.params)
        except (KeyError, IndexError, ValueError):  # a catalog entry with a bad placeholder never hides the error
            return translate(self.key, "en", **self.params)

    @property
    def message(self) -> str:
        return self.text("en")


class BadInput(UserError):
    status = 422


class NotFound(UserError):
    status = 404


class Expired(UserError):
    status = 410


class Busy(UserError):
    """The server cannot take this now; ``retry_after`` (seconds) becomes a Retry-After header."""

    status = 503
    retry_after: int | None = None

    def __init__(self, key: str, /, *, retry_after: int | None = None, **params: object) -> None:
        self.retry_after = retry_after
        super().__init__(key, **params)


class BadSetting(UserError, ValueError):
    """A ``KVSCOPE_*`` variable the server cannot run with: start-up stops with this message, which names it.
    A ``ValueError`` too: a ``Settings`` built in code with a bad value fails as a bad argument does."""


class Forbidden(UserError):
    """Asked by someone the object does not belong to (a class kit's pin, deleted from another browser)."""

    status = 403
