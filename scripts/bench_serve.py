"""`jaxengine serve` under NVIDIA's aiperf, beside `LLM.generate` on the same requests.

    python scripts/bench_serve.py --aiperf /path/to/venv/bin/aiperf \
        [--concurrency 1 4 16] [--rates 2 8] [--requests 64] \
        [--mooncake conversation_trace.jsonl] [--json OUT.json]

Starts the server on the embedded default model at its default settings, and for each
concurrency (streaming completions, `--isl` prompt tokens, `--osl` output tokens, EOS
ignored) and each request rate (Poisson arrivals) runs aiperf, reading its summary:
requests/s, output tokens/s, time to first token and inter-token latency p50 / p99. Then,
with the server stopped, `LLM.generate` takes the prompts aiperf sent at the highest
concurrency, all at once, with the same sampling settings: the server's output tokens/s
at that concurrency over the LLM's is the server's cost.

`--mooncake TRACE`: a Mooncake trace (kvcache-ai/Mooncake, `FAST25-release/traces`) cut to
its first `--mooncake-requests` requests that fit the default model, each 512-token block
scaled to `--block-tokens` tokens (aiperf makes equal blocks of equal text, so shared
prefixes stay shared), replayed at `--mooncake-concurrency` with prefix caching on and off;
reports the hit rate the server counted, and the time to first token of requests the cache
served at least half of against those it served less than a tenth of. `--replica K/M` keeps
the conversations one replica of M serves under prefix-affinity routing (as
`replay_prefix_trace.py` cuts them).

aiperf runs offline here: it reads the model's tokenizer from a stand-in Hugging Face cache
this script links into a temporary directory.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from jaxengine.run_config import DEFAULT_MODEL

REVISION = "0" * 40
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")
SUMMARY = {
    "requests_per_s": ("request_throughput", "avg"),
    "output_tokens_per_s": ("output_token_throughput", "avg"),
    "ttft_p50_ms": ("time_to_first_token", "p50"),
    "ttft_p99_ms": ("time_to_first_token", "p99"),
    "itl_p50_ms": ("inter_token_latency", "p50"),
    "itl_p99_ms": ("inter_token_latency", "p99"),
    "cached_token_pct": ("overall_usage_prompt_cache_read_pct", "avg"),
}


def hf_cache(root: Path) -> Path:
    """A Hugging Face cache holding the default model's tokenizer as `local/default_model`."""
    entry = root / "hub" / "models--local--default_model"
    snapshot = entry / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(REVISION)
    for name in TOKENIZER_FILES:
        if (DEFAULT_MODEL / name).is_file():
            (snapshot / name).symlink_to(DEFAULT_MODEL / name)
    return root / "hub"


class Server:
    def __init__(self, port: int, *flags: str):
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "jaxengine", "serve", "default", "--host", "127.0.0.1", "--port", str(port)]
        self.proc = subprocess.Popen([*cmd, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode}") from None
                time.sleep(0.5)
        raise RuntimeError("the server did not start within 300 s")

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url + "/metrics").read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def aiperf(args, server: Server, cache: Path, out: Path, *extra: str) -> dict:
    """One aiperf run; its summary figures and where it wrote them."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_CACHE=str(cache))
    cmd = [
        args.aiperf,
        "profile",
        "--model",
        "default",
        "--url",
        server.url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        "local/default_model",
        "--random-seed",
        "0",
        "--use-server-token-count",
        "--extra-inputs",
        "ignore_eos:true",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--ui",
        "none",
        "--artifact-dir",
        str(out),
        *extra,
    ]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    return {k: summary.get(m, {}).get(stat) for k, (m, stat) in SUMMARY.items()}


def synthetic(args) -> list[str]:
    return ["--isl", str(args.isl), "--isl-stddev", "0", "--osl", str(args.osl), "--request-count", str(args.requests)]


def llm_peer(args, inputs: Path) -> dict:
    """`LLM.generate` on the prompts of one aiperf run, all at once, as the server got them."""
    from jaxengine import LLM

    payloads = [p for s in json.loads(inputs.read_text())["data"] for p in s["payloads"]]
    prompts = [p["prompt"] for p in payloads]
    llm = LLM(DEFAULT_MODEL)
    params = llm.get_default_sampling_params()
    params.max_tokens, params.ignore_eos = args.osl, True
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds,
    }


def mooncake_cut(args, path: Path, out: Path) -> int:
    """The trace's first requests that fit the default model, blocks scaled to --block-tokens."""
    lines = []
    k, m = (int(x) for x in args.replica.split("/")) if args.replica else (0, 1)
    for line in path.read_text().splitlines():
        r = json.loads(line)
        ids = r["hash_ids"]
        if ids[min(1, len(ids) - 1)] % m != k:  # another replica's conversation
            continue
        output = min(r["output_length"], args.osl)
        if (len(ids) + 1) * args.block_tokens + output > args.mooncake_max_len:
            continue
        # Whole blocks only: a block's text is the same wherever it appears.
        lines.append({"input_length": len(ids) * args.block_tokens, "output_length": output, "hash_ids": ids})
        if len(lines) == args.mooncake_requests:
            break
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return len(lines)


def mooncake(args, cache: Path, work: Path) -> dict:
    trace = work / "mooncake_cut.jsonl"
    n = mooncake_cut(args, Path(args.mooncake), trace)
    results = {"requests": n, "block_tokens": args.block_tokens}
    for caching in (True, False):
        server = Server(args.port, "--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
        try:
            before = server.metrics()
            out = work / f"mooncake_{'on' if caching else 'off'}"
            summary = aiperf(
                args,
                server,
                cache,
                out,
                "--custom-dataset-type",
                "mooncake_trace",
                "--input-file",
                str(trace),
                "--isl-block-size",
                str(args.block_tokens),
                "--concurrency",
                str(args.mooncake_concurrency),
                "--request-count",
                str(n),
            )
            after = server.metrics()
        finally:
            server.stop()
        asked = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
        hit = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        hits, misses = [], []
        for line in (out / "profile_export.jsonl").read_text().splitlines():
            m = json.loads(line)["metrics"]
            ttft = m.get("time_to_first_token", {}).get("value")
            cached = m.get("usage_prompt_cache_read_tokens", {}).get("value") or 0
            share = cached / m["input_sequence_length"]["value"]
            if ttft is not None and share >= 0.5:
                hits.append(ttft)
            elif ttft is not None and share < 0.1:
                misses.append(ttft)
        results["on" if caching else "off"] = {
            **summary,
            "server_hit_rate": hit / asked if asked else 0.0,
            "ttft_p50_ms_hits": statistics.median(hits) if hits else None,
            "ttft_p50_ms_misses": statistics.median(misses) if misses else None,
            "hits": len(hits),
            "misses": len(misses),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf command (pip install aiperf, e.g. in a venv)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--rates", type=float, nargs="*", default=[2.0, 8.0], help="requests/s (Poisson arrivals)")
    parser.add_argument("--requests", type=int, default=64, help="requests per run")
    parser.add_argument("--isl", type=int, default=64, help="prompt tokens")
    parser.add_argument("--osl", type=int, default=32, help="output tokens")
    parser.add_argument("--mooncake", help="a Mooncake trace (JSONL) to replay with prefix caching on and off")
    parser.add_argument("--mooncake-requests", type=int, default=200)
    parser.add_argument("--replica", help="K/M: the conversations replica K of M serves under prefix-affinity routing")
    parser.add_argument("--mooncake-concurrency", type=int, default=4)
    parser.add_argument("--mooncake-max-len", type=int, default=2048, help="the model's max_model_len")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per Mooncake block here")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    cache = hf_cache(work / "hf")
    results = {"concurrency": {}, "rate": {}}
    if args.concurrency or args.rates:
        server = Server(args.port)
        try:
            for c in args.concurrency:
                out = work / f"c{c}"
                results["concurrency"][c] = aiperf(args, server, cache, out, *synthetic(args), "--concurrency", str(c))
                print(f"concurrency {c}: {results['concurrency'][c]}", flush=True)
            for r in args.rates:
                out = work / f"rate{r:g}"
                results["rate"][r] = aiperf(args, server, cache, out, *synthetic(args), "--request-rate", str(r))
                print(f"rate {r:g}/s: {results['rate'][r]}", flush=True)
        finally:
            server.stop()
    if args.concurrency:
        top = max(args.concurrency)
        results["llm_generate"] = llm_peer(args, work / f"c{top}" / "inputs.json")
        served = results["concurrency"][top]["output_tokens_per_s"]
        results["server_over_llm"] = served / results["llm_generate"]["output_tokens_per_s"]
        print(f"LLM.generate on the same {results['llm_generate']['requests']} prompts: {results['llm_generate']}")
        print(f"server at concurrency {top} / LLM.generate, output tokens/s: {results['server_over_llm']:.2f}")
    if args.mooncake:
        results["mooncake"] = mooncake(args, cache, work)
        print(f"mooncake: {json.dumps(results['mooncake'], indent=1)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=lambda x: None if math.isnan(x) else x))
    print(f"aiperf's files: {work}")


if __name__ == "__main__":
    main()
