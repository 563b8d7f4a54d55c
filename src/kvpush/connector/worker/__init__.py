"""Worker-side halves of KVPushConnector (each worker process): one class per engine role."""
