"""group_offsets: exclusive prefix sums of group sizes on the device, one kernel launch."""
