"""aerie's regeneration client vs the official openai AsyncOpenAI client, against the emulator on loopback.

Each client runs in its own fresh process (so CPU seconds and peak RSS are the client's alone) against
one emulator process. aerie's side is the complete client the responses rule uses: journal with batched
fsyncs, accounting, retries, progress. Prints a table and ratios; --json writes the figures.

    .venv/bin/pip install -e ".[bench]"
    .venv/bin/python bench/api_client.py                      # full run (about 2.5 minutes)
    .venv/bin/python bench/api_client.py --quick              # smaller N
    .venv/bin/python bench/api_client.py --tls --quick        # over HTTPS: all three clients at 0 s and 2 s

--tls serves the emulator over HTTPS with a self-signed certificate made for the run (openssl, ECDSA P-256,
the key type OpenRouter's edge presents) and every client trusts exactly that certificate: aerie through
its ``ca_bundle`` client setting, AsyncOpenAI and the bare loop through an SSL context loading it.
Verification stays on everywhere (host name included).
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "moonshotai/kimi-k2.5"


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
    from aerie.api.backends import BackendSettings
    from aerie.api.client import ClientLimits, MoneyGuard, regenerate_shard

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


async def run_openai(base: str, n: int, concurrency: int, workdir: Path, ca_bundle: str | None) -> int:
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    try:  # openai >= 3 ships on the httpx2 fork; older releases on httpx
        import httpx2 as httpx
    except ImportError:
        import httpx

    # Give it the same connection budget as aerie's client (its default pool is smaller).
    client = AsyncOpenAI(
        base_url=base,
        api_key="sk-bench",
        max_retries=8,
        timeout=600,
        http_client=DefaultAsyncHttpxClient(
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
    ) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return done


def worker(args: argparse.Namespace) -> None:
    """One client, one process: prints a JSON line of its own figures."""
    sys.path.insert(0, str(REPO))
    fn = {"aerie": run_aerie, "openai": run_openai, "bare": run_bare}[args.worker]
    with tempfile.TemporaryDirectory() as tmp:
        cpu0, _ = usage()
        t0 = time.perf_counter()
        ok = asyncio.run(fn(args.base, args.n, args.concurrency, Path(tmp), args.ca_bundle))
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
        "aerie.api.emulator",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--latency-mean",
        str(latency),
        "--output-tokens-mean",
        "40",
    ]
    if tls:
        cmd += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    for _ in range(200):
        if port_file.exists() and port_file.read_text().strip():
            return proc
        time.sleep(0.05)
    raise RuntimeError("emulator did not start")


def measure(client: str, latency: float, n: int, concurrency: int, tls: bool = False) -> dict:
    from aerie.api.emulator.tls import write_self_signed_certificate

    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        cert_key = write_self_signed_certificate(Path(tmp)) if tls else None
        emu = start_emulator(latency, port_file, cert_key)
        try:
            scheme = "https" if tls else "http"
            base = f"{scheme}://127.0.0.1:{port_file.read_text().strip()}/api/v1"
            extra = ["--ca-bundle", str(cert_key[0])] if cert_key else []
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    client,
                    "--base",
                    base,
                    "--n",
                    str(n),
                    "--concurrency",
                    str(concurrency),
                    *extra,
                ],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        finally:
            emu.terminate()
            emu.wait(timeout=30)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row.update(latency_s=latency, concurrency=concurrency, tls=tls)
    return row


def tls_main(args: argparse.Namespace, k: float) -> list[dict]:
    """Every client at 0 s and 2 s latency over HTTPS, interleaved so load drift hits all three alike."""
    sizes = {"aerie": int(20000 * k), "openai": int(4000 * k), "bare": int(20000 * k)}
    rows = []
    for latency in (0.0, 2.0):
        for client in ("aerie", "openai", "bare"):
            row = measure(client, latency, sizes[client], args.concurrency, tls=True)
            rows.append(row)
            print(
                f"TLS {client:<7} latency {latency:>3.1f}s  n={row['requests']:>6}  {row['req_per_s']:>8.1f} req/s  "
                f"{row['cpu_s_per_1000']:>6.2f} CPU s/1000  peak RSS {row['peak_rss_mib']:>6.0f} MiB",
                flush=True,
            )
    by = {(r["client"], r["latency_s"]): r for r in rows}
    for latency in (0.0, 2.0):
        a, o, b = (by[(c, latency)] for c in ("aerie", "openai", "bare"))
        print(
            f"latency {latency:.0f} s: aerie = {a['req_per_s'] / b['req_per_s']:.0%} of the bare loop's req/s "
            f"(goal >= 90%), {a['req_per_s'] / o['req_per_s']:.1f}x AsyncOpenAI (goal >= 30x); "
            f"aerie {a['cpu_s_per_1000']:.2f} CPU s/1000 incl. TLS (goal <= 1.0)"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["aerie", "openai", "bare"])
    ap.add_argument("--base")
    ap.add_argument("--n", type=int)
    ap.add_argument("--concurrency", type=int, default=2000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tls", action="store_true", help="serve and call over HTTPS (self-signed certificate)")
    ap.add_argument("--ca-bundle", help=argparse.SUPPRESS)  # worker: the certificate to trust
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    k = 0.25 if args.quick else 1.0
    if args.tls:
        rows = tls_main(args, k)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2) + "\n")
        return
    runs = [
        ("aerie", 0.0, int(20000 * k)),
        ("openai", 0.0, int(4000 * k)),  # throughput and CPU per request
        ("aerie", 2.0, int(20000 * k)),  # 2,000 in flight for 2 s each: the ceiling is 1,000 req/s
        ("bare", 2.0, int(20000 * k)),  # the floor, for reference: a bare aiohttp loop with no journal
    ]
    rows = []
    for client, latency, n in runs:
        row = measure(client, latency, n, args.concurrency)
        rows.append(row)
        print(
            f"{client:<7} latency {latency:>3.1f}s  n={row['requests']:>6}  {row['req_per_s']:>8.1f} req/s  "
            f"{row['cpu_s_per_1000']:>6.2f} CPU s/1000  peak RSS {row['peak_rss_mib']:>6.0f} MiB",
            flush=True,
        )
    a0, o0, a2, b2 = rows
    ceiling = args.concurrency / 2.0
    print(f"\naerie / AsyncOpenAI requests/s at latency 0: {a0['req_per_s'] / o0['req_per_s']:.1f}x (goal >= 10x)")
    print(
        f"aerie CPU s per 1,000 requests: {a0['cpu_s_per_1000']:.2f} (goal <= 1.0); "
        f"AsyncOpenAI {o0['cpu_s_per_1000']:.2f}"
    )
    peak = max(a0["peak_rss_mib"], a2["peak_rss_mib"])
    print(f"aerie peak RSS at {args.concurrency} in flight: {peak:.0f} MiB (goal < 1024)")
    print(
        f"aerie at 2 s latency: {a2['req_per_s']:.0f} req/s = {a2['req_per_s'] / ceiling:.0%} of the "
        f"{ceiling:.0f} req/s ceiling (goal >= 80%); bare aiohttp loop {b2['req_per_s'] / ceiling:.0%} "
        f"at {b2['cpu_s_per_1000']:.2f} CPU s/1000"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
