"""NATS/JetStream adapter shared by the services: connections, streams, publishing."""
