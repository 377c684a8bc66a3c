"""Runs inside the envs/local network namespace (the API listens on that namespace's
loopback): creates a tenant, sends one completion with the official `openai` client, and
prints JSON {text, prompt_tokens, completion_tokens, job}. Arguments: API_URL ADMIN_KEY
MAX_TOKENS, the prompt's token ids as a JSON list on stdin."""

from __future__ import annotations

import json
import sys

import httpx
import openai


def main() -> None:
    url, admin_key, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompt = json.loads(sys.stdin.read())
    admin = {"Authorization": f"Bearer {admin_key}"}
    tenant = httpx.post(f"{url}/admin/tenants", json={"name": "tf-local"}, headers=admin, timeout=10).json()
    key = httpx.post(f"{url}/admin/tenants/{tenant['id']}/keys", headers=admin, timeout=10).json()["key"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    reply = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens)
    job = httpx.get(f"{url}/v1/jobs/{reply.id}", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
    assert reply.usage is not None
    out = {
        "text": reply.choices[0].text,
        "prompt_tokens": reply.usage.prompt_tokens,
        "completion_tokens": reply.usage.completion_tokens,
        "job": job,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
