#!/bin/sh
set -eu
printf 'Hello from ARES!\n' > greeting.txt
