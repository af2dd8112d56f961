"""Seeing the swarm: Prometheus metrics of every peer (`exporter`, `stage_metrics`,
`trainer_metrics`), the trainer's status record and the health page (`health`, `page`)."""
