"""Error classes of vramd and the exit codes the CLI maps them to.

Every error a user can cause (a bad flag, an unsafe arena, a malformed model
file, a missing device) is one of these: the CLI prints `vramd: <message>` on
one line and exits with the class's code; no traceback.  docs/operations.md
lists the codes.
"""


class VramdError(Exception):
    """Base class: a failure with a message meant for the user."""

    exit_code = 1
    http_status = 500


class Timeout(VramdError):
    """Something did not happen in the time allowed (the token, a yield)."""

    exit_code = 1
    http_status = 503


class Interrupted(VramdError):
    """A wait was given up because the process is shutting down."""

    exit_code = 130
    http_status = 503


class UsageError(VramdError):
    """A bad flag, value or configuration key."""

    exit_code = 2
    http_status = 400


class ArenaError(VramdError):
    """The arena directory is missing, unsafe or not laid out as expected."""

    exit_code = 3
    http_status = 503   # a request that meets it (the arena wiped under it) may be retried, not a bug


class TokenError(VramdError):
    """The token file misbehaves: replaced, unlinked, not a regular file."""

    exit_code = 4
    http_status = 503


class DeviceError(VramdError):
    """No Vulkan loader, no device, or a device call failed."""

    exit_code = 5


class InjectedFault(DeviceError):
    """A failpoint's `raise` (vramd/failpoints.py, tests only): a step failed on purpose."""


class OutOfDeviceMemory(DeviceError):
    """A device allocation did not fit; nothing was lost, the model stays cold."""

    exit_code = 6
    http_status = 503
    retry_after = 5  # seconds, the HTTP Retry-After of the 503: memory held by others may come back


class ModelError(VramdError):
    """A model file is malformed or uses something vramd does not support."""

    exit_code = 7
    http_status = 400


class ShuttingDown(VramdError):
    """The daemon is stopping (SIGTERM, `shutdown`): new, queued and cut-short work is refused."""

    exit_code = 1
    http_status = 503


class PeerError(VramdError):
    """A named member, daemon or control socket is absent or does not answer."""

    exit_code = 8
    http_status = 404
