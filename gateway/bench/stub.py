"""A fast OpenAI-shaped stub engine for benchmarks: raw asyncio, HTTP/1.1 keep-alive, fixed answers.

``python -m gateway.bench.stub PORT``. Answers any POST with a chat completion (or, when the body
asks for ``"stream": true``, five server-sent chunks, a usage chunk and ``[DONE]``; with ``"user": "slow"``
too, twenty chunks over two seconds, as a model generating would).
"""

import asyncio
import sys

ANSWER = (b'{"id":"chatcmpl-stub","object":"chat.completion","created":0,"model":"stub","choices":[{"index":0,'
          b'"message":{"role":"assistant","content":"Hello from the stub."},"finish_reason":"stop"}],'
          b'"usage":{"prompt_tokens":12,"completion_tokens":6,"total_tokens":18}}')
WHOLE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + str(len(ANSWER)).encode()
         + b"\r\n\r\n" + ANSWER)
CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"stub","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"stub","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}}\n\n'


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
STREAM_END = _chunked(USAGE) + _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"
STREAM = STREAM_HEAD + b"".join(_chunked(CHUNK) for _ in range(5)) + STREAM_END
# A request whose `user` is "slow" streams like a model generating: a chunk every SLOW_EVERY_S.
SLOW, SLOW_CHUNKS, SLOW_EVERY_S = b'"user":"slow"', 20, 0.1


class Stub(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.buffer = b""

    def data_received(self, data):
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            length = 0
            marker = head.find(b"content-length:")
            if marker >= 0:
                length = int(head[marker + 15:head.find(b"\r\n", marker) if head.find(b"\r\n", marker) > 0 else None])
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            compact = body.replace(b" ", b"")
            stream = b'"stream":true' in compact
            if stream and SLOW in compact:
                self.transport.write(STREAM_HEAD + _chunked(CHUNK))
                loop = asyncio.get_running_loop()
                for index in range(1, SLOW_CHUNKS):
                    loop.call_later(index * SLOW_EVERY_S, self.write, _chunked(CHUNK))
                loop.call_later(SLOW_CHUNKS * SLOW_EVERY_S, self.write, STREAM_END)
            else:
                self.transport.write(STREAM if stream else WHOLE)

    def write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Stub, "127.0.0.1", port, backlog=4096)  # a thousand streams at once
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(int(sys.argv[1])))
