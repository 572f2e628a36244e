"""`jaxengine serve` through OpenAI's own client: completions and chat, streamed and not,
against an in-process `LLM` of the same settings; concurrency, dropped streams, bad
requests, usage, cached tokens, metrics and SIGTERM."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxengine import SamplingParams
from tests.serve.conftest import API_KEY

PROMPT = "def add(a, b):"
CODE = "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"


def http(
    server, method: str, path: str, body: bytes | None = None, key: str | None = API_KEY
) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(server.url + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics by name (one model), request counts by name and finish reason."""
    _, text = http(server, "GET", "/metrics")
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return {
        s.name + (f"/{s.labels['finished_reason']}" if "finished_reason" in s.labels else ""): s.value for s in samples
    }


def test_completion_equals_llm_generate_streamed_or_not(client, reference):
    want = reference.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    got = client.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(reference.get_tokenizer().encode(PROMPT))
    assert got.usage.completion_tokens == 24
    chunks = list(
        client.completions.create(
            model="default",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_chat_equals_llm_chat_streamed_or_not(client, reference):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Read a file."}]
    want = reference.chat(messages, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0]
    got = client.chat.completions.create(model="default", messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.chat.completions.create(
        model="default", messages=messages, max_tokens=20, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_n_samples_seed_and_stop(client, reference):
    got = client.completions.create(model="default", prompt=CODE, max_tokens=12, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    want = reference.generate([CODE], SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7), use_tqdm=False)[0]
    assert sorted(c.text for c in got.choices) == sorted(o.text for o in want.outputs)
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
    # A stop string cuts the text before it, with finish reason "stop".
    free = client.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = free.strip().split()[1]
    cut = client.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]
    streamed = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text  # no stop text sent


def test_logprobs_match_the_llm(client, reference):
    want = reference.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, logprobs=3), use_tqdm=False)[0]
    got = client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    expected = [entry[t].logprob for t, entry in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert all(len(top) <= 3 for top in lp.top_logprobs) and len(lp.top_logprobs) == 6
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy picks the top token


def test_prompt_logprobs_and_token_ids(server, reference):
    want = reference.generate([CODE], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
    body = {"prompt": CODE, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 1, "return_token_ids": True}
    code, got = http(server, "POST", "/v1/completions", json.dumps(body).encode())
    choice = got["choices"][0]
    assert code == 200 and choice["prompt_token_ids"] == want.prompt_token_ids
    assert choice["token_ids"] == want.outputs[0].token_ids
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(want.prompt_token_ids)
    for entry, token, expected in zip(
        choice["prompt_logprobs"][1:], want.prompt_token_ids[1:], want.prompt_logprobs[1:]
    ):
        assert entry[str(token)]["logprob"] == pytest.approx(expected[token].logprob, abs=1e-5)


def _wait_for(condition, seconds: float, what: str) -> None:
    """Polls `condition` until it holds; fails naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        threading.Event().wait(0.05)


def test_a_client_that_stops_waiting_aborts_its_request(server):
    """Not streamed: the server notices the closed connection while the request runs."""
    _wait_for(lambda: metrics(server)["vllm:num_requests_running"] == 0, 120, "the server idle")  # so that the
    # running requests below are this one's
    aborted = metrics(server).get("vllm:request_success_total/abort", 0)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 450, "n": 16, "ignore_eos": True}).encode()  # seconds
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + body)
        # until its 16 samples run (a loaded machine may take a while); then the client hangs up
        _wait_for(lambda: metrics(server)["vllm:num_requests_running"] >= 16, 120, "its 16 samples running")
    _wait_for(
        lambda: metrics(server)["vllm:num_requests_running"] == 0 and metrics(server)["vllm:kv_cache_usage_perc"] == 0,
        120,
        "the samples gone and their pages given back",
    )
    m = metrics(server)
    finished = {k: v for k, v in m.items() if k.startswith("vllm:request_success_total")}
    assert m.get("vllm:request_success_total/abort") == aborted + 16, finished  # aborted, not run to its end


def test_echo_prepends_the_prompt_given_as_text_or_ids(client, reference):
    ids = reference.get_tokenizer().encode(PROMPT)  # with its BOS, which the echo leaves out
    for prompt in (PROMPT, ids):
        got = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0, echo=True)
        assert got.choices[0].text.startswith(PROMPT) and len(got.choices[0].text) > len(PROMPT)


def test_32_concurrent_streams_each_equal_alone(client, reference):
    prompts = [f"def function_{i}(x):" for i in range(32)]
    alone = reference.generate(prompts, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    texts = [None] * 32

    def run(i: int) -> None:
        stream = client.completions.create(
            model="default", prompt=prompts[i], max_tokens=16, temperature=0, stream=True
        )
        texts[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert texts == [o.outputs[0].text for o in alone]


def test_a_dropped_stream_frees_its_request(server, client):
    """The client closes the stream after its first chunk; its 16 samples of 450 tokens (seconds
    of work) are aborted and their pages given back. On a loaded machine the engine may still win
    the race (its chunks wait in the socket's buffers while the client is descheduled): such a try
    ends by length, shows nothing, and is made again."""
    _wait_for(lambda: metrics(server)["vllm:num_requests_running"] == 0, 120, "the server idle")
    for _ in range(3):
        before = metrics(server)
        stream = client.completions.create(
            model="default",
            prompt=PROMPT,
            max_tokens=450,
            n=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        stream.close()
        _wait_for(
            lambda: (
                metrics(server)["vllm:num_requests_running"] == 0 and metrics(server)["vllm:kv_cache_usage_perc"] == 0
            ),
            120,
            "the samples gone and their pages given back",
        )
        m = metrics(server)
        assert m["vllm:num_requests_waiting"] == 0
        aborted = m.get("vllm:request_success_total/abort", 0) - before.get("vllm:request_success_total/abort", 0)
        ended = m.get("vllm:request_success_total/length", 0) - before.get("vllm:request_success_total/length", 0)
        assert aborted + ended == 16, (aborted, ended)  # every sample counted once, by how it ended
        if aborted:
            break
    assert aborted > 0, "no try's samples were aborted: the dropped stream ran to its end"
    # Still serving.
    assert client.completions.create(model="default", prompt=PROMPT, max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", json.dumps({"model": "default"}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "model"),
        ("/v1/completions", json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        ("/v1/completions", json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
        ("/v1/completions", json.dumps({"prompt": "x", "logit_bias": {"a": 1}}).encode(), 400, "logit_bias"),
        ("/v1/completions", json.dumps({"prompt": "x", "logprobs": 999}).encode(), 400, "logprobs"),
        ("/v1/completions", json.dumps({"prompt": [5, 99999]}).encode(), 400, None),
        ("/v1/completions", json.dumps({"prompt": "x " * 600}).encode(), 400, None),  # past max_model_len
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "messages"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user"}], "n": 0}).encode(), 400, "n"),
    ],
)
def test_bad_requests_get_their_4xx_and_the_server_goes_on(server, client, path, body, status, param):
    code, answer = http(server, "POST", path, body)
    assert code == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["code"] == status
    assert answer["error"]["message"]
    if param is not None:
        assert answer["error"]["param"] == param
    assert client.completions.create(model="default", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_structured_outputs(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "a record"}],
        max_tokens=80,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": schema}},
    )
    if chat.choices[0].finish_reason == "stop":
        record = json.loads(chat.choices[0].message.content)
        assert set(record) == {"name", "n"} and isinstance(record["n"], int)
    else:
        assert chat.choices[0].finish_reason == "length"
    picked = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=8, extra_body={"structured_outputs": {"choice": ["left", "right"]}}
    )
    assert picked.choices[0].text in ("left", "right") and picked.choices[0].finish_reason == "stop"
    obj = client.completions.create(
        model="default",
        prompt=PROMPT,
        max_tokens=60,
        seed=3,
        extra_body={"response_format": {"type": "json_object"}},
        stream=True,
    )
    text = "".join(c.choices[0].text for c in obj if c.choices)
    assert text.lstrip().startswith("{")
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        client.completions.create(model="default", prompt=PROMPT, extra_body={"structured_outputs": {"regex": "[a-"}})
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        client.completions.create(model="default", prompt=PROMPT, extra_body={"structured_outputs": {"regexp": "a"}})


def test_api_key_required(server):
    code, answer = http(server, "POST", "/v1/completions", json.dumps({"prompt": "x"}).encode(), key=None)
    assert code == 401 and answer["error"]["code"] == 401
    code, _ = http(server, "POST", "/v1/completions", json.dumps({"prompt": "x"}).encode(), key="wrong")
    assert code == 401
    assert http(server, "GET", "/health", key=None)[0] == 200


def test_models_tokenize_detokenize(server, reference):
    code, models = http(server, "GET", "/v1/models")
    assert code == 200 and models["data"][0]["id"] == "default" and models["data"][0]["max_model_len"] == 512
    ids = reference.get_tokenizer().encode(CODE)
    code, tok = http(server, "POST", "/tokenize", json.dumps({"prompt": CODE}).encode())
    assert tok["tokens"] == ids and tok["count"] == len(ids)
    code, detok = http(server, "POST", "/detokenize", json.dumps({"tokens": ids}).encode())
    assert detok["prompt"] == reference.get_tokenizer().decode(ids)
    assert http(server, "GET", "/version")[1]["version"]


def test_second_identical_prompt_reports_cached_tokens_and_metrics_add_up(server, client):
    prompt = "# a prompt no other test sends\n" + CODE * 4  # several pages
    before = metrics(server)
    first = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 2
    after = metrics(server)
    asked = first.usage.prompt_tokens + second.usage.prompt_tokens
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == asked
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 8
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == asked
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == cached
    assert after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] == 2
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 2
    # each request's 4 tokens: the first step of each is synchronous (nothing in flight), the rest overlap
    assert after["jaxengine:steps_overlapped_total"] - before["jaxengine:steps_overlapped_total"] >= 4
    assert after["jaxengine:steps_synchronous_total"] - before["jaxengine:steps_synchronous_total"] >= 2


def test_sigterm_exits_0(server, client):
    """Last in this module: it stops the module's server."""
    assert client.completions.create(model="default", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    assert server.stop() == 0
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(model="default", prompt=PROMPT, max_tokens=2)
