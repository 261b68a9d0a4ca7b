# Stand-in for the official redis image: Debian bookworm's redis-server (7.0) as user
# redis (999, as in the official image), arguments passed to redis-server.
ARG BASE_IMAGE=kubeshard.local/debian-python:bookworm
FROM ${BASE_IMAGE}
RUN groupadd -r -g 999 redis && useradd -r -g redis -u 999 redis \
 && apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
LABEL io.kubeshard.stand-in="Debian bookworm redis-server (7.0), not the official redis image"
WORKDIR /data
USER 999:999
EXPOSE 6379
ENTRYPOINT ["redis-server"]
