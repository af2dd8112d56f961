# Prometheus from Debian's package, for machines that cannot pull prom/prometheus (docker/smoke.sh):
# it runs as compose.yaml's prometheus service does with the official image.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
