"""Dispatch (numpy; imports the core): the communication plan of one rank, all-to-all split sizes and
index maps as runs of rows, the KV exchange and the KV a server's shards share."""
