"""The heartbeat-monitor: takes heartbeats, and climbs the confirmation ladder before Lost."""
