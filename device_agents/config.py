"""The agent's configuration: a TOML file (`kiln-agent --config agent.toml`).

    server = "http://kiln.internal:8000"      # the Kiln service
    token_file = "agent.token"                # or token = "..." or $KILN_AGENT_TOKEN
    work_dir = "~/.cache/kiln-agent"          # this machine: downloads, bundles, the local device
    poll_interval = 5.0                       # seconds between claims when there is no work
    heartbeat_interval = 15.0
    reconnect_interval = 30.0                 # retry offline devices this often
    max_tasks = 4                             # tasks per claim
    local = true                              # measure on this machine's CPU too
    adb_key = "~/.android/adbkey"             # created (with .pub) when missing

    [[ssh]]
    name = "gpu-box"
    host = "10.0.0.5"
    port = 22
    user = "kiln"
    key = "~/.ssh/kiln_agent"
    known_hosts = "~/.ssh/known_hosts"        # required, unless accept_unknown_host_key = true
    work_dir = "kiln-agent"                   # on the host (relative: to the user's home)

    [[adb]]
    name = "pixel-7"
    host = "192.168.1.20"
    port = 5555
    work_dir = "/data/local/tmp/kiln"

    [adb_usb]
    enabled = true                            # phones on USB (needs adb-shell[usb]; skipped without)

Relative paths on this machine are relative to the configuration file's folder.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

DeviceName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}$")]
TOKEN_ENV = "KILN_AGENT_TOKEN"


class ConfigError(ValueError):
    """The agent's configuration is missing, unreadable or invalid."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SshDevice(_Section):
    name: DeviceName
    host: str = Field(min_length=1)
    port: int = Field(22, ge=1, le=65535)
    user: str = Field(min_length=1)
    key: Path
    known_hosts: Path | None = None
    accept_unknown_host_key: bool = False
    work_dir: str = "kiln-agent"

    @model_validator(mode="after")
    def _host_keys_explicit(self) -> SshDevice:
        if self.known_hosts is None and not self.accept_unknown_host_key:
            raise ValueError(f"ssh device {self.name!r}: set known_hosts to a file holding the "
                             f"host's key (or accept_unknown_host_key = true to skip the check)")
        return self


class AdbDevice(_Section):
    name: DeviceName
    host: str = Field(min_length=1)
    port: int = Field(5555, ge=1, le=65535)
    work_dir: str = "/data/local/tmp/kiln"


class AdbUsb(_Section):
    enabled: bool = False
    work_dir: str = "/data/local/tmp/kiln"


class AgentConfig(_Section):
    server: str = Field(pattern=r"^https?://")
    token: str | None = Field(None, min_length=1)
    token_file: Path | None = None
    work_dir: Path = Path("~/.cache/kiln-agent")
    poll_interval: float = Field(5.0, gt=0)
    heartbeat_interval: float = Field(15.0, gt=0)
    reconnect_interval: float = Field(30.0, gt=0)
    max_tasks: int = Field(4, ge=1, le=64)
    local: bool = True
    local_name: DeviceName = "local"
    adb_key: Path = Path("~/.android/adbkey")
    ssh: list[SshDevice] = Field(default_factory=list)
    adb: list[AdbDevice] = Field(default_factory=list)
    adb_usb: AdbUsb = Field(default_factory=AdbUsb)

    @model_validator(mode="after")
    def _unique_names(self) -> AgentConfig:
        names = [self.local_name] if self.local else []
        names += [d.name for d in self.ssh] + [d.name for d in self.adb]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"device names must be unique; repeated: {', '.join(duplicates)}")
        return self

    def agent_token(self) -> str:
        """The token: `token`, else the contents of `token_file`, else $KILN_AGENT_TOKEN."""
        if self.token:
            return self.token
        if self.token_file is not None:
            try:
                text = self.token_file.read_text().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read token_file {self.token_file}: {exc}") from exc
            if not text:
                raise ConfigError(f"token_file {self.token_file} is empty")
            return text
        if os.environ.get(TOKEN_ENV):
            return os.environ[TOKEN_ENV]
        raise ConfigError(f"no agent token: set token or token_file, or ${TOKEN_ENV}")


def _resolve(path: Path | None, base: Path) -> Path | None:
    if path is None:
        return None
    path = path.expanduser()
    return path if path.is_absolute() else base / path


def load_config(path: str | Path) -> AgentConfig:
    """Read and check the TOML configuration at `path`."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the agent configuration {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    try:
        config = AgentConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}"
                             for e in exc.errors())
        raise ConfigError(f"{path}: {problems}") from None
    return resolve_paths(config, path.parent.resolve())


def resolve_paths(config: AgentConfig, base: Path) -> AgentConfig:
    """Local paths made absolute (relative ones against `base`)."""
    return config.model_copy(update={
        "token_file": _resolve(config.token_file, base),
        "work_dir": _resolve(config.work_dir, base),
        "adb_key": _resolve(config.adb_key, base),
        "ssh": [d.model_copy(update={"key": _resolve(d.key, base),
                                     "known_hosts": _resolve(d.known_hosts, base)})
                for d in config.ssh],
    })
