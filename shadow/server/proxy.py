"""Proxy mode: requests pass to a real OpenAI-compatible engine (vLLM, SGLang, llama.cpp server)
and its responses come back unchanged (status, body, SSE framing); the shadow reads beside it.

The shadow takes the ids from the engine where it returns them (vLLM with `return_token_ids`:
`prompt_token_ids` on the first chunk or the body, `choices[].token_ids`), else it renders them
with the checkpoint's tokenizer and chat template. Between streamed deltas it reads its share.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shadow.errors import ShadowInputError
from shadow.server.service import ShadowService
from shadow.tokenizer import Tokenizer

log = logging.getLogger("shadow.proxy")

PASS_HEADERS = ("authorization", "content-type", "accept", "openai-organization", "openai-project")


def _passed_headers(request_headers) -> dict[str, str]:
    """The client's headers the engine gets (credentials and content negotiation, nothing else)."""
    return {k: v for k, v in request_headers.items() if k.lower() in PASS_HEADERS}


def _on_device(service: ShadowService, turn_id: int, prompt=None, output=None, first=False, share=False,
               wait: bool = True) -> bool:
    """Feed the shadow on the device thread: the prompt, the first token's time, output ids, a
    share slice. Ids the shadow cannot take (none rendered, outside its vocabulary) are skipped:
    the client's response never depends on the shadow. With wait False and the device busy (an
    ask reading), nothing is done and False comes back: the stream does not wait for the shadow."""

    def feed() -> None:
        try:
            if prompt is not None:
                service.set_prompt(turn_id, prompt)
            if first:
                service.first_token(turn_id)
            if output and service.has_prompt(turn_id):
                service.add_output(turn_id, output)
            if share:
                service.share_slice(turn_id)
        except ShadowInputError as e:
            log.warning("the shadow skipped ids of turn %s: %s", turn_id, e)

    if wait:
        service.run_request(feed)
        return True
    return service.device.run_if_idle(feed, "turn")[0]


def _output_ids(choice: dict) -> list[int] | None:
    if isinstance(choice.get("token_ids"), list):
        return [int(i) for i in choice["token_ids"]]
    return None


def _text(choice: dict, chat: bool, streamed: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    part = choice.get("delta" if streamed else "message") or {}
    return part.get("content") or ""


async def forward(
    client: httpx.AsyncClient, upstream: str, path: str, request_headers, body: dict, service: ShadowService,
    tokenizer: Tokenizer, turn_id: int, rendered: list[int] | None, chat: bool, ask_ids: bool,
) -> Response:
    """Forward one completion request; the turn is registered already and ended here."""
    label = None  # chat turns with no label header: the upstream model labels the standing question
    if chat and service.label_from_upstream and service.standing is not None:
        label = label_asker(upstream, request_headers, body, service.standing)
    sent = dict(body)
    if ask_ids:
        sent.setdefault("return_token_ids", True)
    headers = _passed_headers(request_headers)
    url = upstream.rstrip("/") + path
    try:
        upstream_response = await client.send(client.build_request("POST", url, json=sent, headers=headers), stream=True)
    except httpx.HTTPError as e:
        await asyncio.to_thread(service.end_turn, turn_id)  # it may wait for the device
        return JSONResponse({"error": {"message": f"upstream unreachable: {type(e).__name__}: {e}",
                                       "type": "upstream_error"}}, status_code=502)
    if upstream_response.status_code != 200 or not body.get("stream"):
        content = await upstream_response.aread()
        await upstream_response.aclose()
        if upstream_response.status_code == 200:  # the shadow feeds after the response, never before it
            threading.Thread(target=_feed_whole, args=(service, turn_id, content, tokenizer, rendered, chat, label),
                             daemon=True).start()
        else:
            await asyncio.to_thread(service.end_turn, turn_id)
        return Response(content, status_code=upstream_response.status_code,
                        media_type=upstream_response.headers.get("content-type"))

    async def relay():
        first, text, fed_ids = True, [], False
        buffer = b""
        prompt, held = None, []  # what the shadow has not taken yet (the device was busy)
        try:
            async for piece in upstream_response.aiter_raw():
                yield piece  # unchanged bytes: the engine's own SSE framing
                buffer += piece
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    event = _event(line)
                    if event is None:
                        continue
                    choice = (event.get("choices") or [{}])[0]
                    ids = _output_ids(choice)
                    if first and prompt is None:  # the engine sends prompt ids on its first chunk only
                        prompt = event.get("prompt_token_ids") or rendered
                    fed_ids = fed_ids or ids is not None
                    if ids is None:
                        text.append(_text(choice, chat, streamed=True))
                    held += ids or []
                    if await asyncio.to_thread(_on_device, service, turn_id, prompt, held, first, not first, False):
                        prompt, held, first = None, [], False
        finally:
            await upstream_response.aclose()
            if not fed_ids and text:
                held += tokenizer.encode("".join(text))
            # what waited for the device is fed when it is free, after the response has ended
            threading.Thread(target=_finish, args=(service, turn_id, prompt, held, first, label), daemon=True).start()

    return StreamingResponse(relay(), status_code=200, media_type=upstream_response.headers.get("content-type"))


def _finish(service: ShadowService, turn_id: int, prompt, held: list[int], first: bool, label=None) -> None:
    """After the response: feed what waited, ask the upstream for the standing question's label
    when this turn wants one (`label`), end the turn."""
    if prompt is not None or held:
        _on_device(service, turn_id, prompt, held, first)
    if label is not None and service.wants_label(turn_id):
        service.upstream_label(turn_id, *label())
    service.end_turn(turn_id)


def label_asker(upstream: str, request_headers, body: dict, question) -> Callable[[], tuple[str | None, str | None]]:
    """A function that asks the upstream model the standing question after the turn's messages
    (one token, greedy) and returns (the label if the answer is one of the choices, the answer)."""
    headers = _passed_headers(request_headers)
    request = {"messages": list(body["messages"]) + [{"role": "user", "content": question.text}],
               "max_tokens": 1, "temperature": 0, "stream": False}
    if "model" in body:
        request["model"] = body["model"]

    def ask() -> tuple[str | None, str | None]:
        try:
            r = httpx.post(upstream.rstrip("/") + "/chat/completions", json=request, headers=headers, timeout=120)
            r.raise_for_status()
            answer = (r.json()["choices"][0]["message"].get("content") or "").strip()
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            log.warning("the upstream gave no label: %s", e)
            return None, None
        return (answer if answer in question.labels else None), answer

    return ask


def _event(line: bytes) -> dict | None:
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return None
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def _feed_whole(service: ShadowService, turn_id: int, content: bytes, tokenizer: Tokenizer,
                rendered: list[int], chat: bool, label=None) -> None:
    """Feed a whole (non-streamed) answer, then end the turn."""
    try:
        body = json.loads(content)
        choice = (body.get("choices") or [{}])[0]
    except (json.JSONDecodeError, AttributeError):
        service.end_turn(turn_id)
        return  # not JSON: the client gets it as it is; the shadow learns nothing from it
    prompt = body.get("prompt_token_ids") or choice.get("prompt_token_ids") or rendered
    ids = _output_ids(choice)
    if ids is None:
        ids = tokenizer.encode(_text(choice, chat, streamed=False))
    _finish(service, turn_id, prompt, ids, first=True, label=label)
