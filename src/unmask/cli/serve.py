"""``unmask serve``: the OpenAI-compatible server (needs ``pip install 'unmask[serve]'``)."""

from __future__ import annotations

import typer

from unmask.cli.root import app
from unmask.serve.limits import DEFAULT_MAX_N


@app.command("serve")
def serve_cmd(
    model: str = typer.Option(None, "--model", "-m", help="shipped model name or local HF directory (default: the default shipped model)"),
    kind: str = typer.Option(None, "--kind", help="model kind for a local directory: causal, sbd, masked-diffusion, block-diffusion"),
    adapter: str = typer.Option(None, "--adapter", help="gated SBD adapter: a name the model ships (e.g. sbd) or a "
                                "directory; lossless sbd then serves the base model's own output"),
    compile: bool = typer.Option(False, "--compile", help="the ar / lossless sbd, block, multiblock and lossy sbd "
                                 "running batches, and diffusion with the dual cache, on a static KV cache with a "
                                 "compiled step over row and length buckets (a new shape runs eagerly, then compiles once "
                                 "while the server is idle, a minute or more on a busy CPU core; --warmup compiles the first ones ahead); diffusion's other caches, early-bird "
                                 "and Dream's schedule stay eager (README 'Serving')"),
    warmup: bool = typer.Option(False, "--warmup", help="before /health reports ok (it answers 503 'warming up'), "
                                "decode one request of the default decoder and, with --compile, compile its step "
                                "shapes, printing each on stderr (the port is open meanwhile)"),
    draft_sizes: str = typer.Option(None, "--draft-sizes", metavar="ROWS:K,...|auto|off",
                                    help="lossless sbd: draft block size K by running-batch rows (K = 1: plain AR "
                                    "steps, same output); default auto: the served layout, its 8-query stored layout from 3 rows, "
                                    "AR steps from 24 (with --compile: the 8-query layout from 1 row, AR steps from 5; "
                                    "measured on a CPU; linear drafts 1:4,4:2,6:1); off: keep K"),
    draft: str = typer.Option(None, "--draft", help="lossless sbd: the server's draft layout, linear, quadratic, "
                              "budget (the model's calibrated layout for --queries) or D/S/G text such as 3/0,1,3/4; "
                              "AR and lossless rows join its batch; a request's own draft/queries win (default: the "
                              "model's)"),
    queries: int = typer.Option(None, "--queries", help="the query budget of --draft budget (implied when "
                                "--draft is not given): query tokens per row per forward (default: the model's, else 16)"),
    decoder: str = typer.Option(None, "--decoder", "-d", help="default decoder of requests (default: the model kind's natural decoder; "
                                "ar for an SBD model whose lossless sbd is expected slower here, with a note)"),
    block_size: int = typer.Option(None, "--block-size", "-k", help="default block size"),
    policy: str = typer.Option(None, "--policy", help="default commit policy"),
    gamma: float = typer.Option(None, "--gamma", help="default EB-sampler bound γ"),
    preset: str = typer.Option(None, "--preset", help="default γ preset"),
    tau: float = typer.Option(None, "--tau", help="default confidence threshold τ"),
    cache: str = typer.Option(None, "--cache", help="default cache of diffusion / early-bird requests: none, prefix "
                              "or dual (with --compile, dual runs compiled; default: none)"),
    draft_source: str = typer.Option(None, "--draft-source", help="default draft source of ar / lossless sbd "
                                     "requests: lookup or suffix (model-free, any causal model, output = ar), with sbd "
                                     "also block, block+lookup, block+suffix (default: none for ar, block for sbd)"),
    draft_tokens: int = typer.Option(None, "--draft-tokens", help="default most drafted tokens per row per step of "
                                     "lookup / suffix requests (default 8; beside the block draft: its K - 1)"),
    suffix_cache: int = typer.Option(None, "--suffix-cache", metavar="TOKENS",
                                     help="bound, in token ids, of the cache of recent suffix requests' prompts and outputs "
                                     "that suffix drafts draw on (oldest evicted first; 0: none; default 65536, ~50 MiB)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (loopback by default)"),
    port: int = typer.Option(8000, "--port", help="port to listen on (0: any free port)"),
    max_batch_size: int = typer.Option(8, "--max-batch-size", help="rows decoded together"),
    max_queue: int = typer.Option(64, "--max-queue", help="requests that may wait; more are answered 429"),
    timeout: float = typer.Option(600.0, "--timeout", help="default per-request timeout in seconds"),
    max_query_tokens: int = typer.Option(2048, "--max-query-tokens", help="query tokens one request may put into "
                                         "one forward (lossless sbd: 2K linear, K + K² quadratic; diffusion: gen_length); "
                                         "more are answered 400"),
    max_cache_tokens: int = typer.Option(None, "--max-cache-tokens", help="prompt + completion tokens one request may "
                                         "keep in its KV cache (default: the model's context window)"),
    max_body_bytes: int = typer.Option(2 * 2**20, "--max-body-bytes", help="request body size; larger bodies are "
                                       "answered 413 before they are read"),
    max_prompt_chars: int = typer.Option(None, "--max-prompt-chars", help="prompt characters, checked before "
                                         "tokenizing (default: 32 per cache token)"),
    max_n: int = typer.Option(DEFAULT_MAX_N, "--max-n", help="choices one prompt may ask for (OpenAI's n); more are answered 400"),
    api_key: str = typer.Option(None, "--api-key", envvar="UNMASK_API_KEY", show_envvar=True,
                                help="requests must send 'Authorization: Bearer KEY' (401 otherwise); /health, /metrics "
                                "and the playground page stay open"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16"),
) -> None:
    """Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics and the playground at /. Requests may set decoder knobs as extra body fields."""
    from unmask.serve.limits import Limits
    from unmask.serve.server import serve

    limits = Limits(max_body_bytes=max_body_bytes, max_prompt_chars=max_prompt_chars,
                    max_query_tokens=max_query_tokens, max_cache_tokens=max_cache_tokens, max_n=max_n)
    serve(model, kind=kind, adapter=adapter, compile=compile, warmup=warmup, draft_sizes=draft_sizes, limits=limits,
          host=host, port=port, api_key=api_key, max_batch_size=max_batch_size, max_queue=max_queue,
          request_timeout=timeout, device=device, dtype=dtype, decoder=decoder, block_size=block_size, policy=policy,
          gamma=gamma, preset=preset, tau=tau, cache=cache, draft=draft, queries=queries, draft_source=draft_source,
          draft_tokens=draft_tokens, suffix_cache_tokens=suffix_cache)
