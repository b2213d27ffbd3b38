"""The embedded broker: kombu's filesystem transport, made safe for several processes.

kombu's own filesystem channel names a message file before writing it, so a consumer can pick
up a half-written message, and it claims a file by moving it to the system temp folder, which is
not atomic across filesystems. This one writes to a hidden name and renames into place, and
claims by renaming within the broker folder. Messages are plain files in `KILN_DATA_DIR/broker`;
no server runs. Registered as the `kilnfs://` URL scheme.
"""
from __future__ import annotations

import os
import time
import uuid
from queue import Empty
from pathlib import Path

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem, virtual
from kombu.utils.json import dumps, loads

SCHEME = "kilnfs"


def transport_options(folder: Path, poll_seconds: float) -> dict:
    queue, processing, control = folder / "queue", folder / "processing", folder / "control"
    for sub in (queue, processing, control):
        sub.mkdir(parents=True, exist_ok=True)
    return {"data_folder_in": str(queue), "data_folder_out": str(queue),
            "processed_folder": str(processing), "control_folder": str(control),
            "polling_interval": poll_seconds}


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{time.time_ns():020d}_{uuid.uuid4().hex}.{queue}.msg"
        staged = os.path.join(self.data_folder_out, f".put-{uuid.uuid4().hex}")
        try:
            with open(staged, "wb") as f:
                f.write(dumps(payload).encode())
            os.replace(staged, os.path.join(self.data_folder_out, name))
        except OSError as exc:
            raise ChannelError(f"cannot queue a message in {self.data_folder_out}: {exc}") from exc

    def _get(self, queue):
        suffix = f"{queue}.msg"
        for name in sorted(os.listdir(self.data_folder_in)):
            if name.startswith(".") or name.partition(".")[2] != suffix:
                continue
            taken = os.path.join(self.processed_folder, name)
            try:
                os.rename(os.path.join(self.data_folder_in, name), taken)
            except FileNotFoundError:
                continue  # another consumer took it
            try:
                with open(taken, "rb") as f:
                    payload = f.read()
            finally:
                os.remove(taken)
            return loads(payload.decode())
        raise Empty()


class Transport(filesystem.Transport):
    """One broker state (declared bindings) per broker folder, not one per process.

    kombu skips writing a binding it has seen declared; with a process-wide state, a second
    folder used by the same process would get no binding files and lose its messages.
    """

    Channel = Channel
    driver_type = driver_name = SCHEME
    _states: dict[str, virtual.BrokerState] = {}

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        folder = str(client.transport_options.get("control_folder", "control"))
        self.state = self._states.setdefault(folder, virtual.BrokerState())


def register() -> None:
    TRANSPORT_ALIASES.setdefault(SCHEME, "workers.broker:Transport")
