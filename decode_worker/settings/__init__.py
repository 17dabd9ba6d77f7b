"""Typed settings, grouped by concern (`sections`), and their loading with the source of every
value (`load`). Import from here: `from decode_worker.settings import Settings, load_settings`."""

from decode_worker.settings.load import LoadedSettings, env_var_name, load_settings, parse_bool
from decode_worker.settings.sections import (
    ENV_PREFIX,
    UNIFIED_TREE_VARS,
    ApiSettings,
    CacheSettings,
    KvEventsSettings,
    MetricsSettings,
    ModelSettings,
    SchedulerSettings,
    ServerSettings,
    Settings,
    TransferSettings,
)
from decode_worker.settings.speculative import SpeculativeSettings

__all__ = [
    "ENV_PREFIX",
    "UNIFIED_TREE_VARS",
    "ApiSettings",
    "CacheSettings",
    "KvEventsSettings",
    "LoadedSettings",
    "MetricsSettings",
    "ModelSettings",
    "SchedulerSettings",
    "ServerSettings",
    "Settings",
    "SpeculativeSettings",
    "TransferSettings",
    "env_var_name",
    "load_settings",
    "parse_bool",
]
