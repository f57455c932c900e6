"""Envelopes over MQTT: the one place where the protocol meets the transport.

`Channel.send` encodes an envelope and splits it into chunks when it is large; `Channel.
receive` turns raw MQTT messages back into checked envelopes, reassembling chunks. Both the
aggregator and the edge agent use it, so chunking and validation cannot differ between them.

Acknowledgement stays with the caller: `receive` returns, with each envelope, every raw
message that carried a piece of it, so a service using manual acks can ack them all once the
envelope's effect is durable (never a chunk alone: an acked chunk of a message lost in a crash
could not be redelivered). Only redundant copies are acked here: a second copy of a piece still
held (the newest copy stays unacknowledged in its place, so a crash loses nothing) and a copy
of a piece whose message was already put together (its own pieces are acknowledged with it).

Each piece held for an unfinished message is an unacknowledged delivery, a slot of the
broker's in-flight window toward this client; a full window stops all of its traffic. So the
pieces held, all senders together, are bounded by half the transport's window
(`settings.max_inflight` clamped to the broker's Receive Maximum), and so is the number of
pieces a message may have (protocol.Reassembler, docs/transport.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedmq import protocol
from fedmq.config import ProtocolSettings
from fedmq.transport import Message, MqttTransport, PublishHandle


@dataclass
class Received:
    """A whole, checked envelope and the raw messages that carried it."""

    topic: protocol.Topic
    envelope: protocol.Envelope
    messages: list[Message] = field(default_factory=list)


class Refused(Exception):
    """A message (or a partial one) that cannot become an envelope; reply or log, then ack."""

    def __init__(self, error: protocol.ProtocolError, topic: protocol.Topic | None,
                 msg_id: str, messages: list[Message]) -> None:
        super().__init__(str(error))
        self.reason = error.reason
        self.detail = error.message
        self.topic = topic
        self.msg_id = msg_id
        self.messages = messages


class Channel:
    """Send and receive envelopes on one transport, with chunking both ways."""

    def __init__(self, transport: MqttTransport, settings: ProtocolSettings | None = None) -> None:
        self.transport = transport
        self.settings = settings or ProtocolSettings()
        s = self.settings
        self.reassembler = protocol.Reassembler(
            max_message_bytes=s.max_message_bytes,
            max_pending_bytes=s.max_pending_bytes,
            timeout_s=s.chunk_timeout_s,
            max_partials_per_sender=s.max_partials_per_sender,
            max_chunks=s.max_chunks,
            max_held_pieces=self.held_budget(),
        )
        self._pieces: dict[tuple[str, str], dict[int, Message]] = {}
        self.bytes_sent = 0
        """Payload bytes published (all pieces), for the simulator's communication metrics."""
        self.bytes_received = 0

    def held_budget(self) -> int:
        """Most pieces of unfinished messages held unacknowledged at once: half the window in
        force now (it shrinks to the broker's Receive Maximum at connect), so the other half
        always carries other senders' messages."""
        return max(1, self.transport.window // 2)

    def send(self, topic: str, envelope: protocol.Envelope, *, retain: bool = False,
             timeout: float | None = None) -> list[PublishHandle]:
        payload = protocol.encode(envelope)
        if len(payload) > self.settings.max_message_bytes:
            raise protocol.ProtocolError(
                "too_large", f"{envelope.TYPE} of {len(payload)} bytes exceeds the limit of "
                             f"{self.settings.max_message_bytes}")
        pieces = protocol.split(payload, agent=envelope.agent, chunk_bytes=self.settings.chunk_bytes)
        self.bytes_sent += sum(len(p) for p in pieces)
        return [self.transport.publish(topic, p, qos=1, retain=retain, timeout=timeout)
                for p in pieces]

    def receive(self, message: Message) -> Received | None:
        """The envelope `message` completes, None while a chunked one is incomplete.

        Raises `Refused` (with the messages to acknowledge) for anything malformed.
        """
        topic: protocol.Topic | None = None
        env: protocol.Envelope | None = None
        self.bytes_received += len(message.payload)
        try:
            topic = protocol.parse_topic(message.topic)
            # The sender's chunk size is its own: any single message up to the whole-message
            # limit is acceptable.
            env = protocol.decode(message.payload, max_bytes=self.settings.max_message_bytes)
            protocol.check_topic(topic, env)
        except protocol.ProtocolError as e:
            # An envelope that decoded but does not belong here (agent_mismatch, wrong_topic)
            # is answered with its msg_id, so the sender can tell which message was refused.
            msg_id = env.msg_id if env is not None else protocol.readable_msg_id(
                message.payload, self.settings.max_message_bytes)
            raise Refused(e, topic, msg_id, [message]) from None
        if not isinstance(env, protocol.Chunk):
            return Received(topic, env, [message])
        sender = topic.agent or "aggregator"
        key = (sender, env.of)
        self.reassembler.max_held_pieces = self.held_budget()
        try:
            whole = self.reassembler.add(env, sender)
            if whole is None:
                if self.reassembler.holds(sender, env.of):
                    older = self._pieces.setdefault(key, {}).pop(env.index, None)
                    self._pieces[key][env.index] = message
                else:  # a copy of a piece of a message already put together
                    older = message
                if older is not None:
                    self.transport.ack(older)
                return None
            pieces = [*self._pieces.pop(key, {}).values(), message]
            full = protocol.decode(whole, max_bytes=self.settings.max_message_bytes)
            protocol.check_topic(topic, full)
        except protocol.ProtocolError as e:
            self.reassembler.drop(sender, env.of)
            held = self._pieces.pop(key, {})
            raise Refused(e, topic, env.of, [*held.values(), message]) from None
        return Received(topic, full, pieces)

    def expire(self) -> list[Refused]:
        """Partial messages past the chunk timeout, and those dropped to make room for other
        pieces (`reassembler.evictions_pending`), as refusals whose pieces may be acked."""
        out = []
        for sender, of, reason in self.reassembler.expire():
            pieces = list(self._pieces.pop((sender, of), {}).values())
            topic = protocol.parse_topic(pieces[0].topic) if pieces else None
            if reason == "chunk_overflow":
                detail = (f"message {of} from {sender} dropped unfinished to make room: at most "
                          f"{self.reassembler.max_held_pieces} pieces of unfinished messages are "
                          f"held and {sender} held the most; send it again")
            else:
                detail = f"message {of} from {sender} did not complete within {self.settings.chunk_timeout_s}s"
            out.append(Refused(protocol.ProtocolError(reason, detail), topic, of, pieces))
        return out
