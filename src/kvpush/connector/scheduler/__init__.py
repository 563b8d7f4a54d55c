"""Scheduler-side halves of KVPushConnector (EngineCore process): one class per engine role."""
