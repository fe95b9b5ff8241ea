/* The few libzmq declarations dafka's compiled I/O needs (libzmq 4.x ABI).
 *
 * pyzmq's wheels ship no zmq.h and a private copy of libzmq, so nothing is
 * linked: the extension calls through function pointers that dafka.fastio
 * resolves at import from the libzmq pyzmq already loaded. */
#ifndef DAFKA_ZMQ_API_H
#define DAFKA_ZMQ_API_H
#include <stddef.h>

/* zmq_msg_t: 64 bytes, pointer-aligned, the same in every libzmq 4.x. */
typedef union dafka_zmq_msg_t {
    unsigned char _[64];
    void *p;
    double d;
} dafka_zmq_msg_t;

typedef int (*dafka_msg_init_fn)(dafka_zmq_msg_t *msg);
typedef int (*dafka_msg_close_fn)(dafka_zmq_msg_t *msg);
typedef int (*dafka_msg_recv_fn)(dafka_zmq_msg_t *msg, void *socket, int flags);
typedef void *(*dafka_msg_data_fn)(dafka_zmq_msg_t *msg);
typedef size_t (*dafka_msg_size_fn)(const dafka_zmq_msg_t *msg);
typedef int (*dafka_msg_more_fn)(const dafka_zmq_msg_t *msg);
typedef int (*dafka_send_fn)(void *socket, const void *buf, size_t len, int flags);
typedef int (*dafka_errno_fn)(void);
typedef void (*dafka_version_fn)(int *major, int *minor, int *patch);
typedef int (*dafka_getsockopt_fn)(void *socket, int option, void *optval, size_t *optvallen);

#define DAFKA_ZMQ_DONTWAIT 1
#define DAFKA_ZMQ_SNDMORE 2
#define DAFKA_ZMQ_TYPE 16
#define DAFKA_ZMQ_EVENTS 15

#endif
