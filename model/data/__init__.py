"""The data as training reads it: byte windows split and shuffled, Arrow shards written and
read back as rows, batches placed on the devices."""
