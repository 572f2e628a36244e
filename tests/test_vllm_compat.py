"""Scripts written for vLLM's offline API run with only their import changed.

The script below follows vLLM's own offline examples (basic, generate, automatic prefix
caching, simple profiling, chat, the quickstart loop) on the embedded default model; the test swaps
`from vllm import` for `from jaxengine import` and runs it as a user would."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxengine.run_config import DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[1]

VLLM_SCRIPT = """
import os

from vllm import LLM, SamplingParams

os.environ["VLLM_TORCH_PROFILER_DIR"] = {profile!r}
MODEL = {model!r}
prompts = ["def fibonacci(n):", "import numpy as np\\n", "class Stack:", "for i in range(10):"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def print_outputs(outputs):
    print("\\nGenerated Outputs:\\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {{prompt!r}}")
        print(f"Output:    {{generated_text!r}}")
        print("-" * 60)


def main():
    llm = LLM(model=MODEL, gpu_memory_utilization=0.8, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
              enforce_eager=True,
              trust_remote_code=True, tensor_parallel_size=1, seed=0, disable_log_stats=True,
              dtype="auto", block_size=16, enable_prefix_caching=True)
    llm.start_profile()  # simple_profiling
    print_outputs(llm.generate(prompts, sampling_params))
    llm.stop_profile()

    # automatic prefix caching: the second pass reuses the shared prefix
    prefix = "# A small library of numeric helpers, each with a docstring and type hints.\\n" * 3
    generating_prompts = [prefix + prompt for prompt in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    first = llm.generate(generating_prompts, greedy)
    second = llm.generate(generating_prompts, greedy)
    assert [o.outputs[0].text for o in first] == [o.outputs[0].text for o in second]
    assert all(o.num_cached_tokens > 0 for o in second), [o.num_cached_tokens for o in second]
    assert llm.reset_prefix_cache()
    assert llm.generate(generating_prompts[0], greedy)[0].num_cached_tokens == 0

    # parallel samples with logprobs
    params = SamplingParams(n=2, temperature=0.8, logprobs=2, max_tokens=8, seed=0)
    for output in llm.generate(prompts[0], params):
        assert len(output.outputs) == 2
        for completion in output.outputs:
            lp = completion.logprobs[0][completion.token_ids[0]]
            print("sample", completion.index, completion.cumulative_logprob, lp.logprob, lp.rank, lp.decoded_token)

    # chat with a template of our own (the default model ships none)
    conversation = [
        {{"role": "system", "content": "You are a helpful assistant"}},
        {{"role": "user", "content": "Write a function that reverses a list."}},
    ]
    template = "{{% for m in messages %}}# {{{{ m['role'] }}}}: {{{{ m['content'] }}}}\\n{{% endfor %}}def "
    print_outputs(llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=template))
    print_outputs(llm.chat([conversation, conversation], sampling_params, use_tqdm=True, chat_template=template))
    print("tokenizer", type(llm.get_tokenizer()).__name__, llm.get_default_sampling_params().max_tokens)


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow  # the longest test of the suite; tests/engine/test_vllm_api.py checks the pieces fast
def test_a_vllm_offline_script_runs_with_only_its_import_changed(tmp_path):
    script = tmp_path / "offline.py"
    source = VLLM_SCRIPT.format(model=str(DEFAULT_MODEL), profile=str(tmp_path / "profile"))
    assert "from vllm import LLM, SamplingParams" in source
    script.write_text(source.replace("from vllm import", "from jaxengine import"))
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}  # a fresh compilation cache
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert out.count("Prompt:    'def fibonacci(n):'") == 1
    assert out.count("Prompt:    '# system: You are a helpful assistant\\n") == 3
    assert out.count("sample 0 ") == 1 and out.count("sample 1 ") == 1
    assert "tokenizer " in out
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))  # the trace start_profile / stop_profile wrote
