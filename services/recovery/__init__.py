"""The recovery service: drives Lost and stuck tasks on, and repairs Redis and the outbox."""
