"""The command line, ``aerie-emulator`` (or ``python -m aerie.emulator``): flags to settings, serve until
SIGTERM/SIGINT. ``--port 0 --port-file F`` picks a free port and writes it to F once listening; the line
``LISTEN_LINE`` on stdout says the same. Bad flags exit 2 with the reason on stderr, a port taken exits 1."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import ssl
import sys
from pathlib import Path

from aerie.emulator.distributions import LATENCY_DISTS, OUTPUT_DISTS
from aerie.emulator.server import Emulator
from aerie.emulator.settings import (
    BATCH_FAULT_KINDS,
    FAULT_KINDS,
    EmulatorSettings,
    check_settings,
    parse_faults,
    parse_provider,
)
from aerie.emulator.tls import server_tls_context

DESCRIPTION = "A local stand-in for the OpenRouter chat API, for tests, benchmarks and dry runs of a config."
LISTEN_LINE = "aerie-emulator listening on {}"


def build_parser() -> argparse.ArgumentParser:
    d = EmulatorSettings()
    p = argparse.ArgumentParser(prog="python -m aerie.emulator", description=DESCRIPTION)
    a = p.add_argument
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=0, help="0 picks a free port (see --port-file)")
    a("--port-file", help="write the bound port to this file once listening")
    a("--model", action="append", dest="models", help="model id to list (repeatable; default %(default)s)")
    a("--strict-models", action="store_true", help="400 for models not given with --model")
    a("--provider", action="append", dest="providers", help="NAME:QUANT:IN_USD_PER_M:OUT_USD_PER_M (repeatable)")
    a("--api-key-env", help="expect the key held by this environment variable (else any key passes)")
    a("--output-tokens-mean", type=float, default=d.output_tokens_mean)
    a("--output-tokens-dist", choices=OUTPUT_DISTS, default=d.output_tokens_dist)
    a("--reasoning-fraction", type=float, default=d.reasoning_fraction)
    a("--empty-rate", type=float, default=d.empty_rate)
    a("--latency-mean", type=float, default=d.latency_mean, help="seconds")
    a("--latency-dist", choices=LATENCY_DISTS, default=d.latency_dist)
    a("--token-time", type=float, default=d.token_time, help="seconds per output token")
    a("--credits", type=float, help="USD; unlimited when absent")
    a("--key-limit", type=float, help="USD")
    a("--in-flight-budget", type=float, help="USD reserved at input + max_tokens per request in flight")
    a("--fault", action="append", default=[], help="KIND=PROBABILITY (repeatable); kinds: " + ", ".join(FAULT_KINDS))
    a("--faults", action="append", default=[], help="comma-separated KIND=PROBABILITY list")
    a("--fault-seed", type=int, default=d.fault_seed)
    a("--retry-after", type=float, default=d.retry_after, help="seconds, for 429-retry-after")
    a("--slow-seconds", type=float, default=d.slow_seconds)
    a("--request-log", help="JSONL of every chat request (buffered, appended)")
    a(
        "--upstream",
        help="answer with this OpenAI-compatible server (API root, e.g. http://127.0.0.1:8000/v1) "
        "instead of made-up words: its text, token counts and finish reason, OpenRouter's envelope",
    )
    a("--upstream-model", help="model name sent upstream (default: the request's model)")
    a("--upstream-tokenizer", help="tokenizer folder that counts reasoning tokens (default: by character share)")
    a("--upstream-timeout", type=float, default=d.upstream_timeout, help="seconds per upstream request")
    a("--tls-cert", help="serve HTTPS with this PEM certificate (chain); needs --tls-key")
    a("--tls-key", help="PEM private key of --tls-cert")
    a("--batch-model", action="append", dest="batch_models", help="a batch-eligible model (repeatable; default all)")
    a("--batch-provider", action="append", dest="batch_providers", help="a provider slug with a batch endpoint")
    a("--batch-discount", type=float, default=d.batch_discount, help="batch price as a share of the per-token one")
    a("--batch-validate-s", type=float, default=d.batch_validate_s, help="seconds a batch stays in validating")
    a("--batch-latency-mean", type=float, default=d.batch_latency_mean, help="mean seconds an entry takes")
    a("--batch-fault", action="append", default=[], help="KIND=PROBABILITY; kinds: " + ", ".join(BATCH_FAULT_KINDS))
    return p


def settings_from_args(args: argparse.Namespace) -> EmulatorSettings:
    d = EmulatorSettings()
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise SystemExit(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    return EmulatorSettings(
        models=args.models or d.models,
        strict_models=args.strict_models,
        providers=[parse_provider(x) for x in args.providers] if args.providers else d.providers,
        api_key=api_key,
        output_tokens_mean=args.output_tokens_mean,
        output_tokens_dist=args.output_tokens_dist,
        reasoning_fraction=args.reasoning_fraction,
        empty_rate=args.empty_rate,
        latency_mean=args.latency_mean,
        latency_dist=args.latency_dist,
        token_time=args.token_time,
        credits=args.credits,
        key_limit=args.key_limit,
        in_flight_budget=args.in_flight_budget,
        faults=parse_faults(args.faults + args.fault),
        fault_seed=args.fault_seed,
        retry_after=args.retry_after,
        slow_seconds=args.slow_seconds,
        request_log=args.request_log,
        upstream_url=args.upstream,
        upstream_model=args.upstream_model,
        upstream_tokenizer=args.upstream_tokenizer,
        upstream_timeout=args.upstream_timeout,
        batch_models=args.batch_models,
        batch_providers=args.batch_providers,
        batch_discount=args.batch_discount,
        batch_validate_s=args.batch_validate_s,
        batch_latency_mean=args.batch_latency_mean,
        batch_faults=parse_faults(args.batch_fault),
    )


async def _serve(
    settings: EmulatorSettings, host: str, port: int, port_file: str | None, ssl_context: ssl.SSLContext | None = None
) -> None:
    emu = Emulator(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    url = await emu.start(host, port, ssl_context)
    try:
        if port_file:  # written whole then renamed, so a reader never sees half a number
            tmp = Path(f"{port_file}.tmp")
            tmp.write_text(f"{url.split(':')[-1].split('/')[0]}\n")
            tmp.replace(port_file)
        print(LISTEN_LINE.format(url), flush=True)
        await stop.wait()
    finally:
        await emu.stop()


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status (2: bad flags or TLS files, 1: cannot listen)."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        check_settings(settings)  # before binding a port
        if bool(args.tls_cert) != bool(args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = server_tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    except (ValueError, OSError) as exc:  # OSError: unreadable or mismatched certificate/key files
        print(f"aerie-emulator: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(settings, args.host, args.port, args.port_file, tls))
    except OSError as exc:  # e.g. the port is taken
        print(f"aerie-emulator: {exc}", file=sys.stderr)
        return 1
    return 0
