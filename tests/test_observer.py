"""The one observer client (service/base/observer.py) against a hand-driven ROUTER socket: the reply of
the expected type is returned, anything else is skipped, and no reply is one clear error."""

from __future__ import annotations

import threading

import pytest
import zmq

from ddiloco.protocol.messages import FetchGlobal, StatusReply, StatusRequest
from ddiloco.service.base.observer import NoReply, ask, fetch_status
from ddiloco.service.base.wire import decode, encode
from ddiloco.service.ops.launcher import free_port


class FakeSyncer:
    """A ROUTER that answers the first request with the given messages (lists of frames)."""

    def __init__(self, answers: list[list[bytes]]) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.address)
        self.answers = answers
        self.asked: list[object] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if not self.sock.poll(30_000):
            return
        identity, *frames = self.sock.recv_multipart()
        self.asked.append(decode(frames))
        for frames in self.answers:
            self.sock.send_multipart([identity, *frames])

    def close(self) -> None:
        self.thread.join(timeout=30)
        self.sock.close(0)


@pytest.fixture
def fake():
    made: list[FakeSyncer] = []

    def make(*answers: list[bytes]) -> FakeSyncer:
        made.append(FakeSyncer(list(answers)))
        return made[-1]

    yield make
    for f in made:
        f.close()


def frames(msg) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def test_the_reply_comes_back_after_messages_of_another_type_and_unreadable_ones(fake):
    syncer = fake([b"\x00garbage"], frames(FetchGlobal("not a reply")), frames(StatusReply({"shard": 0})))
    assert fetch_status(syncer.address, 30.0) == {"shard": 0}
    assert syncer.asked == [StatusRequest("ddiloco status")]


def test_no_reply_in_time_is_one_clear_error(fake):
    syncer = fake()
    with pytest.raises(NoReply, match=r"no answer from .* within 0.3 s: is the syncer running\?.*--keys DIR"):
        ask(syncer.address, StatusRequest("test"), StatusReply, 0.3)


def test_only_unreadable_answers_say_so(fake):
    syncer = fake([b"\x00garbage"])
    with pytest.raises(NoReply, match="cannot read .* same ddiloco version"):
        ask(syncer.address, StatusRequest("test"), StatusReply, 3.0)  # waits it out: garbage is not the reply
