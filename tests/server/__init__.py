"""Tests of the daemon's server side: sd_notify and the systemd units."""
