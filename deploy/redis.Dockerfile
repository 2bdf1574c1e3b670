# Redis for docker-compose.yml where redis:7-bookworm cannot be pulled: Debian's
# redis-server on the base that deploy/base-image.sh makes (which already holds it).
ARG BASE=prorl-base:bookworm
FROM ${BASE}
RUN command -v redis-server >/dev/null || { apt-get update \
    && apt-get install -y -q --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*; }
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--dir", "/data"]
