"""The long-running services: picker, collector, registry."""
