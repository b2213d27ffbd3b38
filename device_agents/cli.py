"""`kiln-agent --config agent.toml`: run a device agent (see device_agents.config for the file).

    kiln-agent --config agent.toml            # work until interrupted
    kiln-agent --config agent.toml --once     # one round: register, claim once per device, report
                                              # (exit status 1 when no device can be reached)
    kiln-agent --config agent.toml --facts    # print each device's facts as JSON; no service needed
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Sequence

from device_agents.agent import Agent, devices_from_config
from device_agents.backends import DeviceError
from device_agents.client import AuthError
from device_agents.config import AgentConfig, ConfigError, load_config
from device_agents.facts import FactsError
from device_agents.protocol import DeviceState


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln-agent", description="Kiln device agent")
    parser.add_argument("--config", required=True, metavar="AGENT.toml")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="one round, then exit")
    mode.add_argument("--facts", action="store_true",
                      help="print the facts read from every device as JSON and exit")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    if args.log_level != "DEBUG":  # one line per HTTP request drowns what the agent measured
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = load_config(args.config)
        if args.facts:
            return asyncio.run(_print_facts(config))
        agent = asyncio.run(_run(config, args.once))
    except ConfigError as exc:
        print(f"kiln-agent: {exc}", file=sys.stderr)
        return 2
    except AuthError as exc:
        print(f"kiln-agent: the service refused this agent's token: {exc}", file=sys.stderr)
        return 1
    if args.once and not any(d.state != DeviceState.offline for d in agent.devices):
        why = "; ".join(f"{d.name}: {d.error}" for d in agent.devices) or "none is configured"
        print(f"kiln-agent: no device could be reached ({why})", file=sys.stderr)
        return 1
    return 0


async def _run(config: AgentConfig, once: bool) -> Agent:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    agent = Agent(config)
    await agent.run(stop, once=once)
    return agent


async def _print_facts(config: AgentConfig) -> int:
    found, status = {}, 0
    for device in devices_from_config(config):
        try:
            backend = device.make_backend()
            try:
                found[device.name] = (await backend.facts()).model_dump(mode="json")
            finally:
                await backend.close()
        except (DeviceError, FactsError, OSError, ValueError) as exc:
            found[device.name] = {"error": str(exc)}
            status = 1
    print(json.dumps(found, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
