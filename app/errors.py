"""Errors a user can cause. Each carries a message meant for a person and an HTTP status."""

from __future__ import annotations


class UserError(Exception):
    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadInput(UserError):
    status = 422


class NotFound(UserError):
    status = 404


class Expired(UserError):
    status = 410


class Busy(UserError):
    status = 503
