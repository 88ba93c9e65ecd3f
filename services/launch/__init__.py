"""Starting a whole Tidepool on one machine: Redis plus the four services as processes."""
