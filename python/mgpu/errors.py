"""Exception types. The core's errors (raised from C++) are the same classes.

ConfigError (a ValueError) is for anything the user supplied: arguments,
configs, datasets, files. The CLI turns it into one line on stderr and exit 2.
"""

from ._core import CommError, ConfigError, DeviceError, MgpuError, NumericsError


class DataError(ConfigError):
    """A dataset or data file is missing, unreadable or malformed."""


USER_ERRORS = (ConfigError,)

__all__ = ["MgpuError", "ConfigError", "DataError", "DeviceError", "CommError", "NumericsError", "USER_ERRORS"]
