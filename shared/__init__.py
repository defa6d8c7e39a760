"""The sked core: every service and producer imports this package."""
