"""mgpu.perf: the strategy selector's public face, as documented before the package had
layers (`mgpu.perf.recommend(...)`); the code lives in mgpu.selector.
"""

from .selector.memory import check_training_memory, training_memory_bytes
from .selector.profiles import (
    NAMED_PROFILES,
    PROFILE_ALIASES,
    detected_profile,
    list_profiles,
    load_profile,
    named_profile,
    resolve_profile,
    save_profile,
)
from .selector.recommend import auto_bucket, format_recommendation, recommend

__all__ = [
    "NAMED_PROFILES",
    "PROFILE_ALIASES",
    "auto_bucket",
    "check_training_memory",
    "detected_profile",
    "format_recommendation",
    "list_profiles",
    "load_profile",
    "named_profile",
    "recommend",
    "resolve_profile",
    "save_profile",
    "training_memory_bytes",
]
