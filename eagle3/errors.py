"""Errors that the CLI turns into one clear line and a non-zero exit.

Anything raised as an :class:`Eagle3Error` is a known failure (bad input, an
unreachable service, a corrupted object); its message is printed alone, without a
traceback, unless ``EAGLE3_DEBUG=1``.
"""

from __future__ import annotations


class Eagle3Error(Exception):
    """A known failure; the message is the whole story for the user."""

    exit_code = 1


class ConfigError(Eagle3Error):
    """The configuration file or environment overrides are invalid."""

    exit_code = 2


class StoreError(Eagle3Error):
    """The object store cannot be reached, or an object is missing or corrupted."""


class ManifestError(Eagle3Error):
    """A manifest is missing, unparsable or does not match its objects."""


class StageError(Eagle3Error):
    """A stage failed on its input (e.g. malformed prompts, mismatched tokenizer)."""


class RunNotFound(Eagle3Error):
    """The store holds nothing for the run id asked about."""


class UpstreamMissing(Eagle3Error):
    """A stage was started before the stages it reads from were complete."""
