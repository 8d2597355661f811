package io.pelican.worker;

import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.io.UncheckedIOException;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.atomic.AtomicBoolean;

/**
 * A loopback proxy to a server that loses one reply: on the first connection whose client sends {@code EVALSHA}, it
 * lets the command through and closes the connection instead of passing the answer on. Later connections pass
 * through. {@link #request} makes one that loses the request instead: the {@code EVALSHA} never reaches the server.
 */
final class LostReply implements AutoCloseable {
    private final int target;
    private final ServerSocket listener;
    private final AtomicBoolean cut = new AtomicBoolean();
    /** The request is lost rather than its reply. */
    private final boolean request;

    LostReply(int target) {
        this(target, false);
    }

    /** A proxy to {@code target} that loses the first {@code EVALSHA} itself, closing its connection. */
    static LostReply request(int target) {
        return new LostReply(target, true);
    }

    private LostReply(int target, boolean request) {
        this.target = target;
        this.request = request;
        try {
            this.listener = new ServerSocket(0, 50, InetAddress.getLoopbackAddress());
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        }
        Thread accepting = new Thread(this::accept, "lost-reply-accept");
        accepting.setDaemon(true);
        accepting.start();
    }

    int port() {
        return listener.getLocalPort();
    }

    /** Whether a reply was lost. */
    boolean cut() {
        return cut.get();
    }

    @Override
    public void close() throws IOException {
        listener.close();
    }

    private void accept() {
        while (!listener.isClosed()) {
            try {
                Socket client = listener.accept();
                Socket server = new Socket(InetAddress.getLoopbackAddress(), target);
                AtomicBoolean armed = new AtomicBoolean();
                pump("up", client, server, armed, true);
                pump("down", server, client, armed, false);
            } catch (IOException e) {
                return; // closed
            }
        }
    }

    private void pump(String name, Socket from, Socket to, AtomicBoolean armed, boolean upstream) {
        Thread thread = new Thread(() -> {
            byte[] buffer = new byte[65536];
            try (InputStream in = from.getInputStream(); OutputStream out = to.getOutputStream()) {
                for (int read; (read = in.read(buffer)) > 0; ) {
                    if (upstream && !cut.get()
                            && new String(buffer, 0, read, StandardCharsets.ISO_8859_1).toUpperCase().contains("EVALSHA")) {
                        if (request) {
                            cut.set(true);
                            return; // the request is lost: both sockets close
                        }
                        armed.set(true);
                    }
                    if (!upstream && armed.get()) {
                        cut.set(true);
                        return; // the reply is lost: both sockets close
                    }
                    out.write(buffer, 0, read);
                    out.flush();
                }
            } catch (IOException e) {
                // the other side closed
            } finally {
                close(from);
                close(to);
            }
        }, "lost-reply-" + name);
        thread.setDaemon(true);
        thread.start();
    }

    private static void close(Socket socket) {
        try {
            socket.close();
        } catch (IOException e) {
            // closed already
        }
    }
}
