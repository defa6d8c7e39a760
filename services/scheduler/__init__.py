"""The scheduler: accepts submissions, keeps the ready queue, places and dispatches attempts."""
