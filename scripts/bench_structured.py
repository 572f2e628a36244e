"""What structured outputs cost per step on the embedded default model, at its defaults: a
batch of 16 requests with a grammar against the same batch without, in one run.

    python scripts/bench_structured.py [--batch 16] [--max-tokens 64] [--repeats 3]

Reports the time per output token of each batch, the host's time filling grammar bitmasks and
advancing matchers (per step), the device's wait per step (the mask is applied there), and
the time to compile each grammar once (llguidance, on a fresh compiler).
"""

import argparse
import statistics
import time

from jaxengine import LLM, SamplingParams
from jaxengine.engine import batch_builder, output_processor
from jaxengine.engine.structured_output import GrammarCompiler
from jaxengine.run_config import DEFAULT_MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 16},
        "note": {"type": "string"},
    },
    "required": ["name", "items", "note"],
}
GRAMMARS = {
    "none": None,
    "regex": {"regex": "[a-z0-9_ ]{1,400}"},
    "json schema": {"json": SCHEMA},
}


class HostTimer:
    """Time spent in bitmask fills and matcher advances (wrapped where the engine calls them)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        fill = batch_builder.fill_row

        def timed_fill(*args):
            start = time.perf_counter()
            fill(*args)
            self.seconds += time.perf_counter() - start

        batch_builder.fill_row = timed_fill
        append = output_processor.OutputProcessor.append

        def timed_append(processor, seq, token, row):
            if seq.matcher is None:
                return append(processor, seq, token, row)
            start = time.perf_counter()
            append(processor, seq, token, row)
            self.seconds += time.perf_counter() - start

        output_processor.OutputProcessor.append = timed_append


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(DEFAULT_MODEL, background_compile=False)
    timer = HostTimer()
    prompts = [f"def function_{i}(x):" for i in range(args.batch)]
    results = {}
    for round_ in range(args.repeats + 1):  # round 0: every grammar and shape once, untimed
        for name, so in GRAMMARS.items():
            params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=round_, structured_outputs=so)
            llm.engine.timeline.reset()
            timer.seconds = 0.0
            steps = llm.engine.runner.steps
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            if round_ == 0:
                continue
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            num_steps = len(llm.engine.timeline.recent)
            entry = results.setdefault(name, {"ms_per_token": [], "host_ms_per_step": [], "device_wait_ms": []})
            entry["ms_per_token"].append(1000 * wall / tokens * args.batch)  # per sequence's token: a step's time
            entry["host_ms_per_step"].append(1000 * timer.seconds / max(num_steps, 1))
            entry["device_wait_ms"].append(llm.engine.timeline.as_dict()["step_device_wait_ms"])
    assert steps.compiled_on_demand == 0, "a step compiled during the timed runs"
    base = statistics.median(results["none"]["ms_per_token"])
    for name, entry in results.items():
        med = {k: statistics.median(v) for k, v in entry.items()}
        print(
            f"{name:12s} time per output token {med['ms_per_token']:.2f} ms ({med['ms_per_token'] / base:.3f}x), "
            f"host grammar work {med['host_ms_per_step']:.3f} ms/step, device wait {med['device_wait_ms']:.3f} ms/step"
        )
    compiler = GrammarCompiler(
        llm.get_tokenizer(), llm.engine.model_config.vocab_size, llm.engine.model_config.eos_token_ids
    )
    from jaxengine.sampling_params import StructuredOutputsParams

    for name, so in GRAMMARS.items():
        if so is None:
            continue
        start = time.perf_counter()
        compiler.matcher(StructuredOutputsParams.from_value(so), name)
        print(f"{name:12s} grammar compile {1000 * (time.perf_counter() - start):.1f} ms")


if __name__ == "__main__":
    main()
