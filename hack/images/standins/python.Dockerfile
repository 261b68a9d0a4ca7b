# Stand-in for the official python image under the names the e2e tests use: Debian
# bookworm's python3 (3.11), nothing else. No registry is reachable here.
ARG BASE_IMAGE=kubeshard.local/debian-python:bookworm
FROM ${BASE_IMAGE}
RUN ln -s /usr/bin/python3 /usr/local/bin/python
LABEL io.kubeshard.stand-in="Debian bookworm python3 (3.11), not the official python image"
CMD ["python3"]
