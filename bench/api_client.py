"""aerie's regeneration client against its anchors, on loopback against the OpenRouter emulator: the bare aiohttp
loop (the floor: what any aiohttp client costs) and the official ``openai`` AsyncOpenAI client with both of its
transports - its default (httpx) and ``DefaultAioHttpClient`` (aiohttp, the one its README recommends for high
concurrency; needs ``openai[aiohttp]``).

    .venv/bin/pip install -e ".[bench]"
    .venv/bin/python bench/api_client.py --run NAME               # the matrix below, ~25-40 min on 2 quiet cores
    .venv/bin/python bench/api_client.py --run NAME --max-minutes 20 --repeats 2
    .venv/bin/python bench/tables.py                              # the RESULTS tables from every committed run

The matrix: every client x in-flight count (``--concurrency``, default 100, 500, 2,000) x transport (plain HTTP
and HTTPS), each measurement ``--requests`` requests (the same count for every client), at 0 s emulated latency
(so requests/s and CPU per request are the client's own cost), repeated ``--repeats`` times. Within a repeat the
clients of one cell run back to back in an order rotated from repeat to repeat, so load drifts on a shared machine
hit them alike; ratios are taken within a repeat. Every measurement starts a fresh emulator process and a fresh
client process (so CPU seconds and peak RSS are the client's alone, imports included) and records the machine's
load (``uptime``) before and after. The run is written to ``bench/results/api_client/NAME.json`` after every
measurement; ``--max-minutes`` stops starting new measurements after that long (the file then says it is cut).

aerie's side is the complete client the responses rule uses: journal with batched fsyncs, accounting, budget
admission, retries, progress. AsyncOpenAI and the bare loop get the same connection budget (as many connections
as requests in flight) and the same request body. Over HTTPS the emulator serves a self-signed ECDSA P-256
certificate made for the measurement (openssl) and every client verifies it, host name included: aerie through
its ``ca_bundle`` setting, the others through an SSL context loading it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import ssl
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from run_record import code_identity, command_line, machine, machine_load, write_json_atomic

MODEL = "moonshotai/kimi-k2.5"
CLIENTS = ("aerie", "bare", "openai", "openai-aiohttp")
RESULTS = REPO / "bench" / "results" / "api_client"
RUN_FORMAT = "aerie.api-client-bench/1"
OUTPUT_TOKENS = 40


def prompts(n: int) -> list[dict]:
    return [
        {"id": f"bench/{i}", "dataset": "bench", "messages": [{"role": "user", "content": f"Question {i}: say hi"}]}
        for i in range(n)
    ]


def usage() -> tuple[float, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024  # CPU seconds, peak RSS MiB (Linux: KiB)


def client_tls(ca_bundle: str | None) -> ssl.SSLContext | bool:
    """The peers' TLS context: verifying, trusting the run's certificate (True: the library default)."""
    return ssl.create_default_context(cafile=ca_bundle) if ca_bundle else True


async def run_aerie(base: str, n: int, concurrency: int, workdir: Path, ca_bundle: str | None) -> int:
    from aerie.responses.api.backends import BackendSettings
    from aerie.responses.api.client import ClientLimits, MoneyGuard, regenerate_shard

    settings = BackendSettings(
        "openrouter", MODEL, base, 1.0, 0.95, 64, provider={"sort": "price"}, reasoning={"enabled": True}
    )
    out = workdir / "shard-00000.jsonl"
    summary = await regenerate_shard(
        prompts(n),
        out,
        settings,
        api_key="sk-bench",
        guard=MoneyGuard(budget_usd=1e6),
        limits=ClientLimits(concurrency=concurrency, progress_interval=30, ca_bundle=ca_bundle),
        log=lambda m: None,
    )
    return summary["requested_now"]


async def run_openai(
    base: str, n: int, concurrency: int, workdir: Path, ca_bundle: str | None, transport: str = "httpx"
) -> int:
    """AsyncOpenAI on its default transport (httpx) or on ``DefaultAioHttpClient`` (``transport="aiohttp"``)."""
    from openai import AsyncOpenAI, DefaultAioHttpClient, DefaultAsyncHttpxClient

    try:  # openai >= 3 ships on the httpx2 fork; older releases on httpx
        import httpx2 as httpx
    except ImportError:
        import httpx

    http_client_class = DefaultAioHttpClient if transport == "aiohttp" else DefaultAsyncHttpxClient
    # The same connection budget as aerie's client (the SDK's default pool is smaller).
    client = AsyncOpenAI(
        base_url=base,
        api_key="sk-bench",
        max_retries=8,
        timeout=600,
        http_client=http_client_class(
            verify=client_tls(ca_bundle),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        ),
    )
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(p: dict) -> None:
        nonlocal done
        async with sem:
            r = await client.chat.completions.create(
                model=MODEL,
                messages=p["messages"],
                max_tokens=64,
                temperature=1.0,
                top_p=0.95,
                extra_body={"provider": {"sort": "price"}, "reasoning": {"enabled": True}},
            )
            if r.choices:
                done += 1

    await asyncio.gather(*(one(p) for p in prompts(n)))
    await client.close()
    return done


async def run_openai_aiohttp(base: str, n: int, concurrency: int, workdir: Path, ca_bundle: str | None) -> int:
    return await run_openai(base, n, concurrency, workdir, ca_bundle, transport="aiohttp")


async def run_bare(base: str, n: int, concurrency: int, workdir: Path, ca_bundle: str | None) -> int:
    """The floor: a bare aiohttp loop (no journal, no accounting, no retries) - not a usable client."""
    import aiohttp

    queue = list(prompts(n))
    done = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while queue:
            p = queue.pop()
            body = json.dumps(
                {
                    "model": MODEL,
                    "messages": p["messages"],
                    "max_tokens": 64,
                    "temperature": 1.0,
                    "top_p": 0.95,
                    "provider": {"sort": "price"},
                    "reasoning": {"enabled": True},
                }
            )
            async with session.post(f"{base}/chat/completions", data=body) as resp:
                if json.loads(await resp.read()).get("choices"):
                    done += 1

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency, ssl=client_tls(ca_bundle)),
        headers={"Authorization": "Bearer sk-bench", "Content-Type": "application/json"},
        # the SDK's 600 s (aiohttp's default 30 s connect timeout fails 2,000 TLS handshakes on a loaded machine)
        timeout=aiohttp.ClientTimeout(total=600),
    ) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return done


RUNNERS = {"aerie": run_aerie, "bare": run_bare, "openai": run_openai, "openai-aiohttp": run_openai_aiohttp}


def worker(args: argparse.Namespace) -> None:
    """One client, one process: prints a JSON line of its own figures."""
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        cpu0, _ = usage()
        t0 = time.perf_counter()
        ok = asyncio.run(RUNNERS[args.worker](args.base, args.n, args.worker_concurrency, Path(tmp), args.ca_bundle))
        seconds = time.perf_counter() - t0
        cpu1, rss = usage()
    print(
        json.dumps(
            {
                "client": args.worker,
                "requests": ok,
                "seconds": seconds,
                "req_per_s": ok / seconds,
                "cpu_s_per_1000": (cpu1 - cpu0) / max(ok, 1) * 1000,
                "peak_rss_mib": rss,
            }
        )
    )


def start_emulator(latency: float, port_file: Path, tls: tuple[Path, Path] | None = None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "aerie.emulator",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--latency-mean",
        str(latency),
        "--output-tokens-mean",
        str(OUTPUT_TOKENS),
    ]
    if tls:
        cmd += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    for _ in range(600):
        if port_file.exists() and port_file.read_text().strip():
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"the emulator exited with {proc.returncode} before listening")
        time.sleep(0.05)
    proc.terminate()
    raise RuntimeError("emulator did not start")


def measure(client: str, latency: float, n: int, concurrency: int, tls: bool = False) -> dict:
    """One client process against one fresh emulator process; the client's own figures plus the load."""
    from aerie.emulator.tls import write_self_signed_certificate

    load_before = machine_load()
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        cert_key = write_self_signed_certificate(Path(tmp)) if tls else None
        emu = start_emulator(latency, port_file, cert_key)
        try:
            scheme = "https" if tls else "http"
            base = f"{scheme}://127.0.0.1:{port_file.read_text().strip()}/api/v1"
            extra = ["--ca-bundle", str(cert_key[0])] if cert_key else []
            out = subprocess.run(
                [sys.executable, __file__, "--worker", client, "--base", base, "--n", str(n)]
                + ["--worker-concurrency", str(concurrency), *extra],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        finally:
            emu.terminate()
            emu.wait(timeout=30)
    if out.returncode != 0:  # kept as a failed measurement: the run goes on, the table counts it
        lines = out.stderr.strip().splitlines() or [f"exit {out.returncode}"]
        print(out.stderr[-3000:], file=sys.stderr)
        row = {"client": client, "requests": 0, "error": lines[-1][:500]}
    else:
        row = json.loads(out.stdout.strip().splitlines()[-1])
    row.update(
        latency_s=latency,
        concurrency=concurrency,
        transport="https" if tls else "http",
        load_before=load_before,
        load_after=machine_load(),
    )
    return row


def versions() -> dict:
    found = {}
    for dist in ("openai", "aiohttp", "httpx2", "httpx"):
        try:
            found[f"{dist}_version"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def run_matrix(args: argparse.Namespace) -> dict:
    """Every measurement of the matrix in interleaved order, the run file rewritten after each one."""
    path = args.out or RESULTS / f"{args.run}.json"
    started = time.time()
    run = {
        "format": RUN_FORMAT,
        "run": args.run,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "command": command_line(),
        "code": code_identity(REPO),
        "machine": machine(),
        **versions(),
        "settings": {
            "requests": args.requests,
            "concurrencies": args.concurrency,
            "transports": args.transports,
            "repeats": args.repeats,
            "clients": args.clients,
            "latency_s": 0.0,
            "output_tokens_mean": OUTPUT_TOKENS,
            "max_minutes": args.max_minutes,
        },
        "rows": [],
        "complete": False,
    }
    plan = [
        (rep, transport, conc, client)
        for rep in range(args.repeats)
        for transport in args.transports
        for conc in args.concurrency
        for client in args.clients[rep % len(args.clients) :] + args.clients[: rep % len(args.clients)]
    ]
    for i, (rep, transport, conc, client) in enumerate(plan):
        if args.max_minutes and time.time() - started > 60 * args.max_minutes:
            print(f"time box of {args.max_minutes} min reached: {len(plan) - i} measurements not started", flush=True)
            break
        row = {"repeat": rep, **measure(client, 0.0, args.requests, conc, tls=transport == "https")}
        run["rows"].append(row)
        write_json_atomic(path, run)
        if "error" in row:
            print(f"[{i + 1}/{len(plan)}] rep {rep} {transport} {conc} {client}: FAILED {row['error']}", flush=True)
            continue
        print(
            f"[{i + 1}/{len(plan)}] rep {rep} {transport:<5} {conc:>5} in flight  {client:<15} n={row['requests']:>6}  "
            f"{row['req_per_s']:>8.1f} req/s  {row['cpu_s_per_1000']:>6.2f} CPU s/1000  "
            f"peak RSS {row['peak_rss_mib']:>5.0f} MiB  load {row['load_after']['loadavg'][0]:.1f}",
            flush=True,
        )
    else:
        run["complete"] = True
    write_json_atomic(path, run)
    print(f"wrote {path}")
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="the run's name: bench/results/api_client/RUN.json")
    ap.add_argument("--out", type=Path, help="write the run here instead")
    ap.add_argument("--requests", type=int, default=4000, help="requests per measurement, every client alike")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[100, 500, 2000], help="requests in flight")
    ap.add_argument("--transports", nargs="+", choices=("http", "https"), default=["http", "https"])
    ap.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-minutes", type=float, default=0, help="start no measurement after this long (0: none)")
    ap.add_argument("--worker", choices=CLIENTS, help=argparse.SUPPRESS)  # one client process
    ap.add_argument("--base", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-concurrency", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ca-bundle", help=argparse.SUPPRESS)  # worker: the certificate to trust
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if not (args.run or args.out):
        raise SystemExit("give --run NAME (writes bench/results/api_client/NAME.json) or --out FILE")
    args.run = args.run or args.out.stem
    run_matrix(args)


if __name__ == "__main__":
    main()
