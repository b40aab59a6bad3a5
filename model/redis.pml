/* The protocol with Redis leases, SQL results: spin -a model/redis.pml */
#define REDIS 1
#include "bounds.pml"
#include "state.pml"
#include "props.pml"
#include "grant.pml"
#include "store_redis.pml"
#include "results.pml"
#include "worker.pml"
#include "env.pml"
