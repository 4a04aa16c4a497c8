from titanrl.config.job_config import JobConfig
from titanrl.config.manager import help_text, load_config, to_toml

__all__ = ["JobConfig", "help_text", "load_config", "to_toml"]
