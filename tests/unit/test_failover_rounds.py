"""client_sdk.failover's logic: which replica a call goes to, what is sent again, the rounds."""

from __future__ import annotations

import httpx
import openai
import pytest

from client_sdk import failover
from client_sdk.failover import Replicas, replica_urls

REQUEST = httpx.Request("POST", "http://replica/v1/chat/completions")


def _unreachable() -> openai.APIConnectionError:
    """What openai raises when no connection could be made (it chains httpx's error)."""
    try:
        raise openai.APIConnectionError(request=REQUEST) from httpx.ConnectError("refused")
    except openai.APIConnectionError as exc:
        return exc


class Replica:
    def __init__(self, name: str, up: bool = True, answer: Exception | None = None) -> None:
        self.name, self.up, self.answer, self.calls = name, up, answer, 0

    def send(self) -> str:
        self.calls += 1
        if not self.up:
            raise _unreachable()
        if self.answer is not None:
            raise self.answer
        return self.name


def test_urls_come_as_one_a_list_or_commas_else_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert replica_urls("http://a:1") == ["http://a:1"]
    assert replica_urls(" http://a:1 , http://b:2,") == ["http://a:1", "http://b:2"]
    assert replica_urls(["http://a:1", "http://b:2"]) == ["http://a:1", "http://b:2"]
    monkeypatch.setenv("SYMPHONY_URL", "http://c:3,http://d:4")
    assert replica_urls(None) == ["http://c:3", "http://d:4"]
    monkeypatch.delenv("SYMPHONY_URL")
    assert replica_urls(None) == [failover.DEFAULT_URL]
    with pytest.raises(ValueError, match="no scheduler URL"):
        replica_urls(" , ")


def test_a_call_skips_what_cannot_be_reached_and_stays_where_it_was_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover, "ROUND_BACKOFF_S", 0.0)
    a, b, c = Replica("a", up=False), Replica("b"), Replica("c")
    replicas = Replicas([a, b, c], rounds=2)
    assert replicas.call(Replica.send) == "b" and replicas.index == 1
    assert replicas.call(Replica.send) == "b" and a.calls == 1  # a is not tried again while b answers
    b.up = False
    assert replicas.call(Replica.send) == "c" and replicas.index == 2
    c.up, a.up = False, True
    assert replicas.call(Replica.send) == "a"  # round the list


def test_an_answer_is_never_sent_again_and_rounds_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(failover.time, "sleep", slept.append)
    refused = openai.APIStatusError(
        "no", response=httpx.Response(503, request=httpx.Request("POST", "http://a")), body=None
    )
    a, b = Replica("a", answer=refused), Replica("b")
    with pytest.raises(openai.APIStatusError):
        Replicas([a, b], rounds=3).call(Replica.send)
    assert (a.calls, b.calls) == (1, 0)
    down = [Replica("x", up=False), Replica("y", up=False)]
    with pytest.raises(openai.APIConnectionError):
        Replicas(down, rounds=3).call(Replica.send)
    assert [r.calls for r in down] == [3, 3] and slept == [0.5, 1.0]
    with pytest.raises(ValueError):
        Replicas([], rounds=1)


def test_a_call_that_was_sent_and_got_no_answer_is_not_sent_again() -> None:
    """A read timeout or a connection broken after the request went: the replica may be computing
    it; a second replica would compute it again."""
    for cause in (httpx.ReadTimeout("slow"), httpx.RemoteProtocolError("server disconnected")):
        try:
            raise openai.APITimeoutError(request=REQUEST) from cause
        except openai.APIConnectionError as exc:
            sent = exc
        a, b = Replica("a", answer=sent), Replica("b")
        with pytest.raises(openai.APIConnectionError):
            Replicas([a, b], rounds=2).call(Replica.send)
        assert (a.calls, b.calls) == (1, 0)
    try:
        raise openai.APITimeoutError(request=REQUEST) from httpx.ConnectTimeout("no connection")
    except openai.APIConnectionError as exc:
        never_connected = exc
    assert Replicas([Replica("a", answer=never_connected), Replica("b")], rounds=1).call(Replica.send) == "b"
