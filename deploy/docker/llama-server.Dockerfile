# The llama.cpp engine image: a minimal Debian (debootstrap minbase, imported as BASE) plus the
# portable llama-server that Berth builds and caches. Built by `manage.py engines image llamacpp`
# (serving/engines/llamacpp_image.py), never pulled: the build context holds only the binary.
ARG BASE
FROM ${BASE}
COPY llama-server /usr/local/bin/llama-server
# The model directory is bind-mounted read-only at its host path; the runtime sets the entrypoint
# (llama-server) and the arguments, and runs the container on the host network.
ENTRYPOINT ["/usr/local/bin/llama-server"]
