"""The outbox relay: publishes recorded transitions to `sked.events`."""
