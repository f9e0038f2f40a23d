"""The one frozen config object, parsed and validated once from TOML: the sections in
`model`, the file in `loading`."""

from .adapters import AdaptersConfig
from .base import REMOTE_SCHEMES, ConfigPath
from .loading import MIN_KEY_CHARS, load, parse
from .model import (
    API_KEY_ENV,
    DEFAULT_MARKERS,
    CanaryConfig,
    Config,
    ControlConfig,
    EngineConfig,
    GateConfig,
    LogConfig,
    MetricsConfig,
    ReadinessConfig,
    RolloutConfig,
    SourceConfig,
    StateConfig,
)
from .node import NodeConfig

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_MARKERS",
    "MIN_KEY_CHARS",
    "REMOTE_SCHEMES",
    "AdaptersConfig",
    "CanaryConfig",
    "Config",
    "ConfigPath",
    "ControlConfig",
    "EngineConfig",
    "GateConfig",
    "LogConfig",
    "MetricsConfig",
    "NodeConfig",
    "ReadinessConfig",
    "RolloutConfig",
    "SourceConfig",
    "StateConfig",
    "load",
    "parse",
]
